"""The balancer's Prometheus metrics: its serving stats (sluice.runtime.metrics) and the
routing state (each backend, the retry budget, the planner), all read when scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.balancer.fanout import FanoutStats
from sluice.routing.breaker import State
from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import report
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Health, Pool

BACKEND = ["backend"]


class RoutingCollector(Collector):
    def __init__(
        self,
        pool: Pool,
        budget: RetryBudget,
        planner: Planner[Any],
        fanout: FanoutStats | None = None,
    ) -> None:
        self.pool = pool
        self.budget = budget
        self.planner = planner
        self.fanout = fanout  # the service's, when it is to be reported

    def collect(self) -> Iterator[Metric]:
        backends = sorted(self.pool.backends.values(), key=lambda b: b.address)
        limits = self.planner.limits
        yield _per_backend(
            GaugeMetricFamily(
                "sluice_backend_in_flight", "calls in flight to the backend", labels=BACKEND
            ),
            backends,
            lambda b: b.in_flight,
        )
        yield _per_backend(
            GaugeMetricFamily(
                "sluice_backend_healthy",
                "1 while the backend's health watch says SERVING, else 0 (not yet heard "
                "from, NOT_SERVING)",
                labels=BACKEND,
            ),
            backends,
            lambda b: b.health == Health.SERVING,
        )
        yield _per_backend(
            GaugeMetricFamily(
                "sluice_backend_breaker_open",
                "1 while the backend's breaker is OPEN or HALF_OPEN, else 0",
                labels=BACKEND,
            ),
            backends,
            lambda b: b.breaker.state is not State.CLOSED,
        )
        yield _per_backend(
            GaugeMetricFamily(
                "sluice_backend_ewma_seconds",
                "the backend's peak-EWMA latency estimate",
                labels=BACKEND,
            ),
            backends,
            lambda b: b.latency.current(),
        )
        yield _per_backend(
            CounterMetricFamily(
                "sluice_backend_calls", "attempts sent to the backend", labels=BACKEND
            ),
            backends,
            lambda b: b.calls,
        )
        yield _per_backend(
            CounterMetricFamily(
                "sluice_backend_failures",
                "attempts that counted against the backend",
                labels=BACKEND,
            ),
            backends,
            lambda b: b.failures,
        )
        yield _per_backend(
            GaugeMetricFamily(
                "sluice_backend_limit",
                "the concurrency limit learned from the backend's overload refusals (0: none)",
                labels=BACKEND,
            ),
            backends,
            lambda b: limits.limit(b) or 0.0,
        )
        yield CounterMetricFamily(
            "sluice_retries", "attempts sent again to another backend", value=self.budget.retries
        )
        yield CounterMetricFamily(
            "sluice_retry_budget_refused",
            "retries the retry budget refused",
            value=self.budget.refused,
        )
        yield CounterMetricFamily(
            "sluice_shed",
            "calls refused at once because every backend held its learned limit",
            value=limits.shed,
        )
        yield CounterMetricFamily(
            "sluice_unavailable",
            "calls answered UNAVAILABLE: no backend could take them",
            value=self.planner.unavailable,
        )
        yield CounterMetricFamily(
            "sluice_ejections", "latency outlier ejections", value=self.pool.ejections
        )
        yield from report.families(self.planner.hedging)
        if self.fanout is not None:
            yield CounterMetricFamily(
                "sluice_fanout_calls",
                "Predict calls split into chunks (--fanout-rows)",
                value=self.fanout.calls,
            )
            yield CounterMetricFamily(
                "sluice_fanout_chunks",
                "chunks those calls were split into, each sent as a call of its own",
                value=self.fanout.chunks,
            )


def _per_backend(
    family: GaugeMetricFamily | CounterMetricFamily,
    backends: list[Backend],
    value: Callable[[Backend], float],
) -> GaugeMetricFamily | CounterMetricFamily:
    for backend in backends:
        family.add_metric([backend.address], float(value(backend)))
    return family
