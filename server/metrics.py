"""The server's Prometheus metrics: the batchers and cache read when scraped; queue wait,
model time and batch rows as histograms fed by hooks set only here (metrics on)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.core.stats import Histogram
from sluice.runtime.metrics import ROWS, RUN_SECONDS, SECONDS, histogram_family
from sluice.server.dataplane.batcher import BatcherStats
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.models import Model, Models


class DataplaneCollector(Collector):
    """Queue, batches, admission and cache, summed over models as they come and go (unloaded
    models' counts stay, so counters never go back)."""

    def __init__(self, models: Models, cache: LRUCache) -> None:
        self.models = models
        self.cache = cache
        self.wait = Histogram(SECONDS)
        self.run = Histogram(RUN_SECONDS)
        self.rows = Histogram(ROWS)
        # Stats, not batchers (those hold sessions): a retiring model still counts refusals.
        self.gone: list[tuple[str, BatcherStats]] = []
        for model in models:
            self.installed(model)
        models.listeners.append(self)

    def _ran(self, count: int, seconds: float) -> None:
        self.run.observe(seconds)
        self.rows.observe(count)

    def installed(self, model: Model) -> None:
        model.batcher.on_wait = self.wait.observe
        model.batcher.on_run = self._ran

    def removed(self, model: Model) -> None:
        self.gone.append((model.name, model.batcher.stats))

    def collect(self) -> Iterator[Metric]:
        batchers, cache = [m.batcher for m in self.models], self.cache
        named = [(m.name, m.batcher.stats) for m in self.models] + self.gone
        stats = [s for _, s in named]
        yield GaugeMetricFamily(
            "sluice_queue_depth",
            "requests waiting in the batcher queue",
            value=sum(len(b.queue) for b in batchers),
        )
        yield histogram_family(
            "sluice_queue_wait_seconds",
            "time a request waited in the batcher queue (0 when an idle instance took it)",
            [((), self.wait)],
        )
        yield histogram_family(
            "sluice_model_seconds", "model run wall time per batch", [((), self.run)]
        )
        yield histogram_family("sluice_batch_rows", "rows per model run", [((), self.rows)])
        yield CounterMetricFamily(
            "sluice_admission_refused",
            "requests refused at the door: queue full, or no time to answer before the deadline",
            value=sum(s.rejected for s in stats),
        )
        yield CounterMetricFamily(
            "sluice_expired",
            "requests dropped in the queue: their deadline passed while waiting",
            value=sum(s.expired for s in stats),
        )
        yield CounterMetricFamily("sluice_cache_hits", "result cache hits", value=cache.hits)
        yield CounterMetricFamily("sluice_cache_misses", "result cache misses", value=cache.misses)
        yield CounterMetricFamily(
            "sluice_cache_evictions", "result cache evictions", value=cache.evictions
        )
        yield GaugeMetricFamily(
            "sluice_cache_bytes", "bytes held by the result cache", value=cache.bytes
        )
        yield GaugeMetricFamily(
            "sluice_cache_entries", "entries in the result cache", value=len(cache)
        )
        yield from _padding(named)


def _padding(named: list[tuple[str, BatcherStats]]) -> Iterator[Metric]:
    """Padded positions against real ones, by model name."""
    tokens: dict[str, list[int]] = {}
    for name, stats in named:
        if stats.padded_tokens:
            counts = tokens.setdefault(name, [0, 0])
            counts[0] += stats.real_tokens
            counts[1] += stats.padded_tokens
    real = CounterMetricFamily(
        "sluice_real_tokens",
        "positions the padded inputs of requests held (rows x their own lengths)",
        labels=["model"],
    )
    padded = CounterMetricFamily(
        "sluice_padded_tokens",
        "positions the runs of requests with padded inputs ran, padding included "
        "(rows x the lengths they were padded to)",
        labels=["model"],
    )
    efficiency = GaugeMetricFamily(
        "sluice_padding_efficiency",
        "real over padded positions run (1: no padding was run)",
        labels=["model"],
    )
    for name, (held, ran) in sorted(tokens.items()):
        real.add_metric([name], held)
        padded.add_metric([name], ran)
        efficiency.add_metric([name], held / ran)
    yield real
    yield padded
    yield efficiency
