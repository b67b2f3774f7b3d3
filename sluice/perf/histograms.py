"""Latency statistics for the sweep: HDR histograms (microseconds, 3 significant digits)
that merge exactly across load-generator processes, and knee detection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 600_000_000  # ten minutes: anything slower is clamped, never dropped
DIGITS = 3
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)


def record(histogram: HdrHistogram, seconds: float) -> None:
    histogram.record_value(min(max(int(seconds * 1e6), LOWEST_US), HIGHEST_US))


def merge(encoded: Sequence[bytes]) -> HdrHistogram:
    """One histogram from the encoded histograms of several processes."""
    total = new_histogram()
    for blob in encoded:
        part = HdrHistogram.decode(blob)
        if part.get_total_count():  # an empty part would drag min to 0
            total.add(part)
    return total


@dataclass(frozen=True)
class Latency:
    """Milliseconds."""

    count: int
    min: float
    p50: float
    p90: float
    p99: float
    p999: float
    max: float
    mean: float


def summarize(histogram: HdrHistogram) -> Latency:
    count = histogram.get_total_count()
    if not count:
        return Latency(0, *([0.0] * 7))
    p50, p90, p99, p999 = (histogram.get_value_at_percentile(p) / 1000 for p in PERCENTILES)
    return Latency(
        count=count,
        min=histogram.get_min_value() / 1000,
        p50=p50,
        p90=p90,
        p99=p99,
        p999=p999,
        max=histogram.get_max_value() / 1000,
        mean=histogram.get_mean_value() / 1000,
    )


def find_knee(
    throughput: Sequence[float], p99: Sequence[float], *, growth: float = 0.05
) -> int | None:
    """Index of the last level before p99 more than doubles or throughput stops growing
    (grows by less than `growth`, a fraction). None when no level shows either."""
    for i in range(len(throughput) - 1):
        if p99[i + 1] > 2 * p99[i] or throughput[i + 1] < throughput[i] * (1 + growth):
            return i
    return None
