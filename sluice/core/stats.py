"""Serving statistics: call and error counts, in-flight calls, latency percentiles over a
sliding window of recent calls, and their Health message. Single-threaded (event loop)
use; the clock is injected."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
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

    def begin(self) -> float:
        """Count a call as started; returns its start time for `end`."""
        self.requests += 1
        self.in_flight += 1
        return self._clock()

    def end(self, started: float, error: str | None = None) -> None:
        """Count a call as finished, with its status name when it failed."""
        self.in_flight -= 1
        if error is not None:
            self.errors[error] += 1
        self._window[self._next] = self._clock() - started
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
    }
