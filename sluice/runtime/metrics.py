"""Prometheus metrics at `/metrics` (`--metrics-port`), served on the process's own event
loop so collectors read the stats objects on the thread that writes them. Counts are read at
scrape time (nothing per call); only latency histograms are observed per call."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sluice.core.stats import Histogram, ServingStats
from sluice.core.tenants import Tenants

log = logging.getLogger("sluice.metrics")

PATH = "/metrics"
# End to end, queue wait: 50 us to 10 s. Model runs: from 10 us. Rows: powers of two.
SECONDS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
RUN_SECONDS = (0.00001, 0.000025, *SECONDS)
ROWS = tuple(float(1 << i) for i in range(13))  # 1 .. 4096
MAX_REQUEST = 16 * 1024  # request line and headers
READ_TIMEOUT_S = 10.0


def histogram_family(
    name: str,
    documentation: str,
    histograms: Iterable[tuple[Sequence[str], Histogram]] = (),
    labels: Sequence[str] = (),
) -> HistogramMetricFamily:
    """A Prometheus histogram from `Histogram`s, one per label values."""
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    for values, hist in histograms:
        buckets = [(_bound(b), float(n)) for b, n in hist.cumulative()]
        family.add_metric(list(values), buckets, hist.sum)
    return family


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class ServingCollector(Collector):
    """A process's calls by status, in flight, and the end-to-end latency histogram."""

    def __init__(self, stats: ServingStats, method: str = "Predict") -> None:
        self.stats = stats
        self.method = method
        self.seconds = Histogram(SECONDS)
        stats.observer = self.seconds.observe

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        calls = CounterMetricFamily(
            "sluice_calls", "calls finished, by method and status", labels=["method", "code"]
        )
        failed = sum(stats.errors.values())
        calls.add_metric([self.method, "OK"], stats.requests - stats.in_flight - failed)
        for code, count in sorted(stats.errors.items()):
            calls.add_metric([self.method, code], count)
        yield calls
        yield histogram_family(
            "sluice_call_seconds",
            "calls' time in this process, end to end",
            [((self.method,), self.seconds)],
            labels=["method"],
        )
        yield GaugeMetricFamily("sluice_in_flight", "calls in flight", value=stats.in_flight)
        refusals = CounterMetricFamily(
            "sluice_refusals",
            "calls refused at the door, by reason (unauthenticated, quota, overload, permission)",
            labels=["reason"],
        )
        for reason, count in sorted(stats.refusals.items()):
            refusals.add_metric([reason], count)
        yield refusals


def thread_cpu_clock() -> Callable[[], float]:
    """The CPU seconds of the calling thread, readable from any thread where the platform can."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return time.thread_time
    clock = time.pthread_getcpuclockid(threading.get_ident())
    return lambda: time.clock_gettime(clock)


class LoopCollector(Collector):
    """The event loop thread's CPU time (make it there): its rate is the loop's busy share,
    the one signal of calls waiting in grpc core's queue unseen (docs/KUBERNETES.md)."""

    def __init__(self, cpu_clock: Callable[[], float] | None = None) -> None:
        self.cpu_clock = cpu_clock or thread_cpu_clock()

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "sluice_loop_cpu_seconds",
            "CPU time of the event loop's thread (its rate: the loop's busy share)",
            value=self.cpu_clock(),
        )


class TenantCollector(Collector):
    """Each tenant's calls by outcome, and in flight."""

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "sluice_tenant_calls",
            "calls of each tenant by outcome: OK, the status of a failure, or refused:REASON",
            labels=["tenant", "outcome"],
        )
        flying = GaugeMetricFamily(
            "sluice_tenant_in_flight", "each tenant's calls in flight", labels=["tenant"]
        )
        for account in self.tenants:
            name = account.tenant.name
            calls.add_metric([name, "OK"], account.ok)
            for code, count in sorted(account.failed.items()):
                calls.add_metric([name, code], count)
            for reason, count in sorted(account.refused.items()):
                calls.add_metric([name, f"refused:{reason}"], count)
            flying.add_metric([name], account.in_flight)
        yield calls
        yield flying


def new_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry of `collectors` and the process's own; call it on the event loop's thread."""
    registry = CollectorRegistry(auto_describe=False)
    own = (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR, LoopCollector())
    for collector in (*own, *collectors):
        registry.register(collector)
    return registry


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """Serve `registry` at http://HOST:PORT/metrics on the running loop; OSError if taken."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            status, body, kind = _answer(head, registry)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + (b"" if head.startswith(b"HEAD ") else body)
            )
            await writer.drain()
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
        ):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port, limit=MAX_REQUEST)


def _answer(head: bytes, registry: CollectorRegistry) -> tuple[str, bytes, str]:
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return "400 Bad Request", b"bad request\n", "text/plain; charset=utf-8"
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method not in (b"GET", b"HEAD"):
        return "405 Method Not Allowed", b"GET or HEAD only\n", "text/plain; charset=utf-8"
    if target != PATH.encode():
        return "404 Not Found", b"metrics are at /metrics\n", "text/plain; charset=utf-8"
    return "200 OK", generate_latest(registry), CONTENT_TYPE_LATEST


def bound_port(server: asyncio.Server) -> int:
    port: int = server.sockets[0].getsockname()[1]
    return port


async def serve_first_free(
    registry: CollectorRegistry, host: str, ports: Sequence[int]
) -> asyncio.Server:
    """Serve on the first of `ports` that binds; the last OSError when none does."""
    error: OSError | None = None
    for port in ports:
        try:
            return await serve_metrics(registry, host, port)
        except OSError as exc:
            error = exc
    raise error or OSError("no port to bind")


async def start(registry: CollectorRegistry, host: str, ports: Sequence[int]) -> asyncio.Server:
    """Serve `registry` on the first free one of `ports` and log where (not worded as the
    "listening on" line that launchers read)."""
    server = await serve_first_free(registry, host, ports)
    log.info("metrics at http://%s:%d%s", host, bound_port(server), PATH)
    return server
