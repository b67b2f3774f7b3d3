"""Hedging in the balancer (--hedge-after-ms): a call whose first attempt hangs is answered by
its hedge, and its Health reply, its metrics and its attempt spans say so; the flag's values."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from sluice.balancer.metrics import RoutingCollector
from sluice.balancer.service import ATTEMPT, BalancerService
from sluice.balancer.settings import BalancerSettings
from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import HedgeSettings
from sluice.routing.hedge.marks import CANCELLED, HEDGE
from sluice.routing.pool import Pool
from sluice.runtime.spans import ATTEMPTS
from sluice.v1 import inference_pb2 as pb
from sluice.wire.mux import Reply
from tests.unit.test_metrics import scrape, value
from tests.unit.test_tracing import BODY, PARENT, FakeContext, named, only


class FirstHangs:
    """The backends' transports: the first attempt of all never answers (a paused server)
    until it is cancelled; every later one answers with its backend's address."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.cancelled: list[str] = []

    def upstream(self, address: str) -> Upstream:
        return Upstream(self, address)


class Upstream:
    def __init__(self, shared: FirstHangs, address: str) -> None:
        self.shared = shared
        self.address = address

    async def predict(
        self, body: bytes, metadata: dict[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        self.shared.sent.append(self.address)
        if len(self.shared.sent) == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.shared.cancelled.append(self.address)
                raise
        return Reply(0, body=self.address.encode())


def hedging_balancer(after_ms: str = "1") -> tuple[BalancerService, FirstHangs]:
    pool = Pool()
    added, _ = pool.set_addresses(["a:1", "b:1", "c:1"])
    upstreams = FirstHangs()
    for backend in added:
        backend.transport = upstreams.upstream(backend.address)
    service = BalancerService(
        pool, RetryBudget(), node_id="b1", hedge=HedgeSettings.parse(after_ms)
    )
    assert service.planner.hedging is not None
    service.planner.hedging.budget.tokens = 1.0  # as if ten calls had gone before
    return service, upstreams


def health(service: BalancerService) -> pb.HealthResponse:
    context = FakeContext()
    body = asyncio.run(service.health(pb.HealthRequest().SerializeToString(), context))  # type: ignore[arg-type]
    return pb.HealthResponse.FromString(body)


def test_a_hung_attempt_is_answered_by_its_hedge_and_health_and_metrics_count_it() -> None:
    service, upstreams = hedging_balancer()

    async def call() -> Reply:
        reply = await service.forward(BODY, {}, None)
        await asyncio.sleep(0)  # the loser's cancellation runs
        return reply

    reply = asyncio.run(call())
    first, second = upstreams.sent
    assert reply.code == 0 and reply.body == second.encode() and second != first
    assert upstreams.cancelled == [first]
    stats = health(service).balancer
    assert (stats.hedges, stats.hedges_won, stats.hedges_cancelled) == (1, 1, 1)
    assert stats.hedge_after_ms == pytest.approx(1.0)
    assert [b.in_flight for b in service.pool.backends.values()] == [0, 0, 0]
    assert all(b.failures == 0 for b in service.pool.backends.values())
    samples = scrape(RoutingCollector(service.pool, service.budget, service.planner))
    assert value(samples, "sluice_hedges_total") == 1
    assert value(samples, "sluice_hedges_won_total") == 1
    assert value(samples, "sluice_hedges_cancelled_total") == 1
    assert value(samples, "sluice_hedge_budget_refused_total") == 0
    assert value(samples, "sluice_hedge_after_seconds") == pytest.approx(0.001)


def test_without_the_flag_nothing_is_hedged_or_reported() -> None:
    pool = Pool()
    pool.set_addresses(["a:1"])
    service = BalancerService(pool, RetryBudget(), node_id="b1")
    assert service.planner.hedging is None
    assert health(service).balancer.hedges == 0
    samples = scrape(RoutingCollector(service.pool, service.budget, service.planner))
    assert not any(name.startswith("sluice_hedge") for name, _ in samples)


def test_the_hedge_is_an_attempt_span_of_its_own_marked_as_one(
    spans: InMemorySpanExporter,
) -> None:
    service, upstreams = hedging_balancer()

    async def call() -> Reply:
        reply = await service.forward(BODY, {"traceparent": PARENT}, None)
        await asyncio.sleep(0)
        return reply

    assert asyncio.run(call()).code == 0
    served = only(spans, "sluice.balancer/Predict")
    assert served.attributes is not None and served.attributes[ATTEMPTS] == 2
    attempts = {
        str(s.attributes["server.address"]): s for s in named(spans, ATTEMPT) if s.attributes
    }
    first, second = upstreams.sent
    hedge = attempts[second].attributes
    assert hedge is not None and hedge[HEDGE] is True
    assert str(hedge["sluice.routing.why"]).startswith(f"hedge beside {first}")
    cancelled = attempts[first]
    assert cancelled.attributes is not None and HEDGE not in cancelled.attributes
    assert cancelled.attributes[CANCELLED] == "another attempt answered first"
    assert cancelled.status.status_code is StatusCode.UNSET  # no fault of its backend


@pytest.mark.parametrize(("flag", "after_s"), [("5", 0.005), ("auto", None)])
def test_the_flag_sets_the_delay(flag: str, after_s: float | None) -> None:
    hedge = BalancerSettings(backend=["a:1"], hedge_after_ms=flag).hedge
    assert hedge is not None and hedge.after_s == after_s and hedge.ratio == 0.1
    assert BalancerSettings(backend=["a:1"]).hedge is None


@pytest.mark.parametrize(
    ("fields", "words"),
    [({"hedge_after_ms": "fast"}, "--hedge-after-ms"), ({"hedge_ratio": 2.0}, "--hedge-ratio")],
)
def test_a_bad_flag_is_refused_at_start(fields: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        BalancerSettings(backend=["a:1"], **fields)  # type: ignore[arg-type]
