"""Serving statistics: call and error counts, in-flight calls, latency percentiles over a
sliding window of recent calls, and their Health message. Single-threaded (event loop)
use; the clock is injected."""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LatencySummary:
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


class ServingStats:
    def __init__(self, window: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._window = np.zeros(window, dtype=np.float64)
        self._filled = 0
        self._next = 0
        self.requests = 0
        self.in_flight = 0
        self.errors: Counter[str] = Counter()
        # Calls refused at the door, by reason (unauthenticated, quota, overload, ...).
        self.refusals: Counter[str] = Counter()
        # Called with each finished call's seconds; None (nothing done) unless an exporter
        # sets it (the metrics' latency histogram).
        self.observer: Callable[[float], None] | None = None

    def begin(self) -> float:
        """Count a call as started; returns its start time for `end`."""
        self.requests += 1
        self.in_flight += 1
        return self._clock()

    def end(self, started: float, error: str | None = None, reason: str = "") -> None:
        """Count a call as finished, with its status name when it failed, and the reason
        when it was refused at the door."""
        self.in_flight -= 1
        if error is not None:
            self.errors[error] += 1
        if reason:
            self.refusals[reason] += 1
        seconds = self._clock() - started
        self._window[self._next] = seconds
        if self.observer is not None:
            self.observer(seconds)
        self._next = (self._next + 1) % len(self._window)
        self._filled = min(self._filled + 1, len(self._window))

    @property
    def uptime_s(self) -> float:
        return self._clock() - self._started

    def latency(self) -> LatencySummary:
        if not self._filled:
            return LatencySummary(0, 0.0, 0.0, 0.0, 0.0)
        seconds = self._window[: self._filled]
        p50, p90, p99 = np.percentile(seconds, [50, 90, 99]) * 1000.0
        return LatencySummary(
            self._filled, float(p50), float(p90), float(p99), float(seconds.max() * 1000.0)
        )


class Histogram:
    """Counts of observations at or below each upper bound (not cumulative: `counts[i]`
    holds those in (bounds[i-1], bounds[i]], the last one those above every bound) and their
    sum. Plain numbers, no lock: observe from one thread (the event loop); an exporter reads
    it when scraped. About a quarter of a microsecond per observation."""

    def __init__(self, bounds: Sequence[float]) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError("bounds must be increasing and not empty")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) for each bound, then (inf, count)."""
        total = 0
        out = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


def health_fields(stats: ServingStats) -> dict[str, Any]:
    """The HealthResponse fields every Sluice process reports from its serving stats, as plain
    values (protobuf takes a dict for a message field)."""
    latency = stats.latency()
    return {
        "uptime_s": stats.uptime_s,
        "requests": stats.requests,
        "errors": sum(stats.errors.values()),
        "errors_by_code": dict(stats.errors),
        "latency": asdict(latency),
        "in_flight": stats.in_flight,
        "refusals": dict(stats.refusals),
    }
