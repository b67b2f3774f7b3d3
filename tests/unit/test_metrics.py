"""Prometheus metrics: the plain histogram, the hooks (off by default), each collector read
against stats objects set by hand, the /metrics HTTP handler, and JSON log lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from sluice.balancer.main import WORKER_SLOT_ENV, WORKERS, WORKERS_ENV
from sluice.balancer.metrics import RoutingCollector
from sluice.balancer.settings import BalancerSettings
from sluice.core.stats import Histogram, ServingStats
from sluice.routing.breaker import BreakerSettings, State
from sluice.routing.budget import RetryBudget
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Health, Pool
from sluice.runtime import metrics
from sluice.runtime.process import REQUEST_ID, TRACE_ID, JsonFormatter, setup_logging
from sluice.server.dataplane.batcher import Arrays, Batcher, BatcherStats, Pending
from sluice.server.dataplane.cache import Entry, LRUCache
from sluice.server.dataplane.models import Models
from sluice.server.metrics import DataplaneCollector
from sluice.server.settings import ServerSettings
from sluice.wire.mux import Reply

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(*collectors: Collector) -> Samples:
    """The exposition of `collectors`, parsed back: value by (sample name, labels)."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return parse(generate_latest(registry).decode())


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# The plain histogram and the hooks


def test_histogram_counts_each_value_in_the_first_bucket_that_holds_it() -> None:
    hist = Histogram([0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        hist.observe(v)
    assert hist.counts == [2, 2, 1]  # an upper bound holds its own value (le)
    assert hist.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert hist.count == 5 and hist.sum == pytest.approx(8.65)


@pytest.mark.parametrize("bounds", [[], [1.0, 1.0], [2.0, 1.0]])
def test_histogram_refuses_bounds_that_do_not_increase(bounds: list[float]) -> None:
    with pytest.raises(ValueError):
        Histogram(bounds)


def test_serving_stats_tell_the_observer_each_calls_seconds_only_when_set() -> None:
    clock = Clock()
    stats = ServingStats(clock=clock)
    assert stats.observer is None
    stats.end(stats.begin())  # nothing set: nothing called
    seen: list[float] = []
    stats.observer = seen.append
    started = stats.begin()
    clock.now += 0.25
    stats.end(started, "INTERNAL")
    assert seen == [0.25]


# The serving collector (server and balancer)


def test_serving_collector_reports_calls_by_code_in_flight_and_latency() -> None:
    clock = Clock()
    stats = ServingStats(clock=clock)
    collector = metrics.ServingCollector(stats)
    for error in (None, None, "INVALID_ARGUMENT"):
        started = stats.begin()
        clock.now += 0.002
        stats.end(started, error)
    stats.begin()  # still in flight: not counted as finished
    samples = scrape(collector)
    assert value(samples, "sluice_calls_total", method="Predict", code="OK") == 2
    assert value(samples, "sluice_calls_total", method="Predict", code="INVALID_ARGUMENT") == 1
    assert value(samples, "sluice_in_flight") == 1
    assert value(samples, "sluice_call_seconds_count", method="Predict") == 3
    assert value(samples, "sluice_call_seconds_sum", method="Predict") == pytest.approx(0.006)
    assert value(samples, "sluice_call_seconds_bucket", method="Predict", le="0.001") == 0
    assert value(samples, "sluice_call_seconds_bucket", method="Predict", le="0.0025") == 3
    assert value(samples, "sluice_call_seconds_bucket", method="Predict", le="+Inf") == 3


# The server's dataplane collector


class FakeBatcher:
    """What the collector reads of a batcher: its queue, its stats, its hooks."""

    def __init__(self, waiting: int, stats: BatcherStats) -> None:
        self.queue = [object()] * waiting
        self.stats = stats
        self.on_wait: Any = None
        self.on_run: Any = None


@dataclass
class FakeModel:
    name: str
    version: str
    batcher: FakeBatcher


def test_dataplane_collector_reads_queue_admission_and_cache_when_scraped() -> None:
    batchers = [
        FakeBatcher(3, BatcherStats(rejected=2, expired=1)),
        FakeBatcher(1, BatcherStats(rejected=5)),
    ]
    served = Models()
    for i, batcher in enumerate(batchers):
        served.install(FakeModel("m", str(i + 1), batcher))  # type: ignore[arg-type]
    cache = LRUCache(max_entries=2, max_bytes=1 << 20)
    for key in (b"a", b"b", b"c"):  # the third evicts the first
        cache.put(key, Entry(b"x" * 10))
    cache.get(b"b")
    cache.get(b"a")
    collector = DataplaneCollector(served, cache)
    samples = scrape(collector)
    assert value(samples, "sluice_queue_depth") == 4
    assert value(samples, "sluice_admission_refused_total") == 7
    assert value(samples, "sluice_expired_total") == 1
    assert value(samples, "sluice_cache_hits_total") == 1
    assert value(samples, "sluice_cache_misses_total") == 1
    assert value(samples, "sluice_cache_evictions_total") == 1
    assert value(samples, "sluice_cache_entries") == 2
    assert value(samples, "sluice_cache_bytes") == 20
    assert value(samples, "sluice_queue_wait_seconds_count") == 0

    for batcher in batchers:  # the collector set the hooks
        batcher.on_wait(0.003)
        batcher.on_run(4, 0.0002)
    samples = scrape(collector)
    assert value(samples, "sluice_queue_wait_seconds_count") == 2
    assert value(samples, "sluice_queue_wait_seconds_bucket", le="0.0025") == 0
    assert value(samples, "sluice_queue_wait_seconds_bucket", le="0.005") == 2
    assert value(samples, "sluice_model_seconds_count") == 2
    assert value(samples, "sluice_model_seconds_sum") == pytest.approx(0.0004)
    assert value(samples, "sluice_batch_rows_bucket", le="2.0") == 0
    assert value(samples, "sluice_batch_rows_bucket", le="4.0") == 2
    assert value(samples, "sluice_batch_rows_sum") == 8

    # A version swapped out: its counts stay in the totals; the new one gets the hooks.
    fresh = FakeBatcher(0, BatcherStats(rejected=1))
    served.install(FakeModel("m", "3", fresh))  # type: ignore[arg-type]
    served.remove("m", "1")
    samples = scrape(collector)
    assert value(samples, "sluice_admission_refused_total") == 8
    assert value(samples, "sluice_queue_depth") == 1
    assert fresh.on_wait is not None and fresh.on_run is not None


class Gated:
    """A fake instance, y = 2x, whose runs take `seconds` on the fake clock once let go;
    `inline` makes it take the fast path when idle."""

    def __init__(self, clock: Clock, seconds: float, *, inline: bool = False) -> None:
        self.clock = clock
        self.seconds = seconds
        self.inline = inline
        self.gate = asyncio.Event()

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        if not self.inline:
            return None
        self.clock.now += self.seconds
        return {"y": np.asarray(inputs["x"]) * 2}

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        await self.gate.wait()
        self.clock.now += self.seconds
        return [{"y": np.asarray(p.inputs["x"]) * 2} for p in batch]


async def submit(batcher: Batcher, x: int) -> Arrays:
    return await batcher.submit({"x": np.array([x])}, ["y"], rows=1, group="g")


async def test_batcher_hooks_see_queue_waits_and_each_runs_rows_and_time() -> None:
    clock = Clock()
    runner = Gated(clock, 0.004)
    batcher = Batcher([runner], max_rows=8, budget_s=1.0, clock=clock)
    waits: list[float] = []
    runs: list[tuple[int, float]] = []
    batcher.on_wait, batcher.on_run = waits.append, lambda r, s: runs.append((r, s))
    calls = [asyncio.create_task(submit(batcher, 0))]
    await asyncio.sleep(0)  # 0 is taken alone at once; its run starts at 1 ms
    clock.now += 0.001
    calls += [asyncio.create_task(submit(batcher, x)) for x in (1, 2, 3)]
    await asyncio.sleep(0)
    runner.gate.set()
    await asyncio.gather(*calls)
    assert runs == [(1, pytest.approx(0.004)), (3, pytest.approx(0.004))]
    # 0 waited nothing; 1-3 arrived at 1 ms and were taken when 0's run ended, at 5 ms.
    assert waits == [0.0, *[pytest.approx(0.004)] * 3]


async def test_the_inline_fast_path_counts_as_a_run_with_no_wait() -> None:
    clock = Clock()
    batcher = Batcher([Gated(clock, 0.0001, inline=True)], clock=clock)
    waits: list[float] = []
    runs: list[tuple[int, float]] = []
    assert batcher.on_wait is None and batcher.on_run is None  # off unless metrics are on
    await submit(batcher, 1)
    batcher.on_wait, batcher.on_run = waits.append, lambda r, s: runs.append((r, s))
    await submit(batcher, 2)
    assert waits == [0.0]
    assert runs == [(1, pytest.approx(0.0001))]


# The balancer's routing collector


class LearnedLimits:
    """What the collector reads of the planner's limits."""

    def __init__(self, limits: dict[str, float], shed: int) -> None:
        self.limits = limits
        self.shed = shed

    def limit(self, backend: Backend) -> float | None:
        return self.limits.get(backend.address)


def test_routing_collector_reports_each_backend_and_the_planner() -> None:
    clock = Clock()
    pool = Pool(breaker=BreakerSettings(jitter=0.0), clock=clock, rng=random.Random(1))
    pool.set_addresses(["a:1", "b:1"])
    budget = RetryBudget(clock=clock)
    planner = Planner(pool, budget, Reply, clock=clock)
    a, b = pool.backends["a:1"], pool.backends["b:1"]
    a.health, b.health = Health.SERVING, Health.NOT_SERVING
    a.in_flight, a.calls, a.failures = 3, 10, 2
    b.breaker.state = State.HALF_OPEN
    a.latency.observe(0.02)
    planner.limits = LearnedLimits({"a:1": 3.0}, shed=4)  # type: ignore[assignment]
    planner.unavailable = 5
    budget.retries, budget.refused = 6, 7
    pool.ejections = 1
    samples = scrape(RoutingCollector(pool, budget, planner))
    assert value(samples, "sluice_backend_in_flight", backend="a:1") == 3
    assert value(samples, "sluice_backend_in_flight", backend="b:1") == 0
    assert value(samples, "sluice_backend_healthy", backend="a:1") == 1
    assert value(samples, "sluice_backend_healthy", backend="b:1") == 0
    assert value(samples, "sluice_backend_breaker_open", backend="a:1") == 0
    assert value(samples, "sluice_backend_breaker_open", backend="b:1") == 1
    assert value(samples, "sluice_backend_ewma_seconds", backend="a:1") == pytest.approx(0.02)
    assert value(samples, "sluice_backend_calls_total", backend="a:1") == 10
    assert value(samples, "sluice_backend_failures_total", backend="a:1") == 2
    assert value(samples, "sluice_backend_limit", backend="a:1") == 3
    assert value(samples, "sluice_backend_limit", backend="b:1") == 0
    assert value(samples, "sluice_retries_total") == 6
    assert value(samples, "sluice_retry_budget_refused_total") == 7
    assert value(samples, "sluice_shed_total") == 4
    assert value(samples, "sluice_unavailable_total") == 5
    assert value(samples, "sluice_ejections_total") == 1


# The HTTP side


@pytest.fixture
def fresh_registry() -> Iterator[CollectorRegistry]:
    stats = ServingStats()
    stats.end(stats.begin(), "UNAVAILABLE")
    yield metrics.new_registry(metrics.ServingCollector(stats))


def fetch(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read()
    except urllib.error.HTTPError as exc:
        with closing(exc):
            return exc.code, exc.headers["Content-Type"], exc.read()


async def test_metrics_are_served_at_slash_metrics_and_only_there(
    fresh_registry: CollectorRegistry,
) -> None:
    server = await metrics.serve_metrics(fresh_registry, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{metrics.bound_port(server)}"
    try:
        status, kind, body = await asyncio.to_thread(fetch, f"{base}/metrics?x=1")
        assert status == 200 and kind.startswith("text/plain")
        samples = parse(body.decode())
        assert value(samples, "sluice_calls_total", method="Predict", code="UNAVAILABLE") == 1
        assert any(name == "process_cpu_seconds_total" for name, _ in samples)
        status, _, body = await asyncio.to_thread(fetch, f"{base}/metrics", "HEAD")
        assert status == 200 and body == b""
        assert (await asyncio.to_thread(fetch, f"{base}/"))[0] == 404
        assert (await asyncio.to_thread(fetch, f"{base}/metrics", "POST"))[0] == 405
        reader, writer = await asyncio.open_connection("127.0.0.1", metrics.bound_port(server))
        writer.write(b"nonsense\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 400")
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_worker_takes_the_first_free_port_of_its_range(
    fresh_registry: CollectorRegistry,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with socket.socket() as probe:  # a free port, most likely, right after it
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        server = await metrics.serve_first_free(fresh_registry, "127.0.0.1", [port, free])
        try:
            assert metrics.bound_port(server) == free
        finally:
            server.close()
            await server.wait_closed()
        with pytest.raises(OSError):
            await metrics.serve_first_free(fresh_registry, "127.0.0.1", [port])


def test_metrics_ports_of_the_balancers_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_SLOT_ENV, raising=False)
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert WORKERS.metrics_ports(9100, is_worker=False) == [9100]
    monkeypatch.setenv(WORKERS_ENV, "4")
    assert WORKERS.metrics_ports(9100, is_worker=True) == [9101, 9102, 9103]
    monkeypatch.setenv(WORKER_SLOT_ENV, "1")  # the supervisor says which: that one only
    assert WORKERS.metrics_ports(9100, is_worker=True) == [9102]


def test_settings_check_metrics_port_and_log_format() -> None:
    assert ServerSettings().metrics_port == 0 and ServerSettings().log_format == "text"
    with pytest.raises(ValueError, match="--metrics-port"):
        ServerSettings(metrics_port=70000)
    with pytest.raises(ValueError, match="--log-format"):
        ServerSettings(log_format="xml")
    with pytest.raises(ValueError, match="--metrics-port"):
        BalancerSettings(backend=["a:1"], metrics_port=65535, workers=2)
    assert BalancerSettings(backend=["a:1"], metrics_port=65534, workers=2).workers == 2


# Logs


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("sluice.test", logging.INFO, __file__, 1, message, args, None)
    made.__dict__.update(extra)
    return made


def test_json_lines_carry_time_level_logger_and_message() -> None:
    line = json.loads(JsonFormatter().format(record("listening on %s:%d", "127.0.0.1", 8001)))
    assert line["level"] == "INFO" and line["logger"] == "sluice.test"
    assert line["message"] == "listening on 127.0.0.1:8001"
    assert line["time"].endswith("+00:00")
    assert "request_id" not in line and "trace_id" not in line


def test_json_lines_carry_request_and_trace_ids_from_the_record_or_the_context() -> None:
    formatter = JsonFormatter()
    line = json.loads(formatter.format(record("m", request_id="r-1", trace_id="abc")))
    assert (line["request_id"], line["trace_id"]) == ("r-1", "abc")
    request, trace = REQUEST_ID.set("r-2"), TRACE_ID.set("def")
    try:
        line = json.loads(formatter.format(record("m")))
        assert (line["request_id"], line["trace_id"]) == ("r-2", "def")
        line = json.loads(formatter.format(record("m", request_id="r-3")))
        assert line["request_id"] == "r-3"
    finally:
        REQUEST_ID.reset(request)
        TRACE_ID.reset(trace)


def test_json_lines_take_the_trace_id_of_the_current_span() -> None:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    span = NonRecordingSpan(SpanContext(0xABC, 0xDEF, is_remote=False, trace_flags=TraceFlags(1)))
    with trace.use_span(span):
        line = json.loads(JsonFormatter().format(record("m")))
    assert line["trace_id"] == f"{0xABC:032x}"
    assert "trace_id" not in json.loads(JsonFormatter().format(record("m")))


def test_json_lines_keep_the_traceback() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        made = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(made))
    assert "RuntimeError: boom" in line["exception"]


def test_setup_logging_installs_the_chosen_format(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    try:
        root.handlers.clear()
        setup_logging("info", "json")
        logging.getLogger("sluice.x").info("ready", extra={"request_id": "q"})
        assert json.loads(stream.getvalue())["request_id"] == "q"
        with pytest.raises(ValueError, match="log format"):
            setup_logging("info", "xml")
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
