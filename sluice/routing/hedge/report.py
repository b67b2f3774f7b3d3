"""What hedging reports: its counts and delay as Prometheus families (the balancer's
/metrics, names `sluice_hedge*`), and as the Health reply's BalancerStats hedge fields
(those a dashboard shows: SHOWN)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from sluice.routing.hedge.policy import Hedging

# BalancerStats' hedge fields that `sluice top` shows, by label.
SHOWN = (("hedges", "hedges"), ("hedges won", "hedges_won"))


class Stats(Protocol):
    """The hedge fields of sluice.v1's BalancerStats."""

    hedges: int
    hedges_won: int
    hedges_cancelled: int
    hedges_refused: int
    hedge_after_ms: float


def families(hedging: Hedging | None) -> Iterator[Metric]:
    """The metric families of `hedging` (none without it)."""
    if hedging is None:
        return
    yield CounterMetricFamily(
        "sluice_hedges",
        "second copies of a call sent to another backend while its attempt was out",
        value=hedging.sent,
    )
    yield CounterMetricFamily(
        "sluice_hedges_won", "calls a hedge answered first", value=hedging.won
    )
    yield CounterMetricFamily(
        "sluice_hedges_cancelled",
        "attempts cancelled because another attempt of the call answered first",
        value=hedging.cancelled,
    )
    yield CounterMetricFamily(
        "sluice_hedge_budget_refused",
        "hedges the hedge budget refused",
        value=hedging.budget.refused,
    )
    yield GaugeMetricFamily(
        "sluice_hedge_after_seconds",
        "how long an attempt may go unanswered before it is hedged (0: auto, not known yet)",
        value=hedging.delay() or 0.0,
    )


def fill(stats: Stats, hedging: Hedging | None) -> None:
    """`stats`' hedge fields, as `hedging` counts them (left 0 without it)."""
    if hedging is None:
        return
    stats.hedges = hedging.sent
    stats.hedges_won = hedging.won
    stats.hedges_cancelled = hedging.cancelled
    stats.hedges_refused = hedging.budget.refused
    stats.hedge_after_ms = (hedging.delay() or 0.0) * 1000
