"""Serving statistics under a fake clock."""

from __future__ import annotations

import pytest

from sluice.core.stats import ServingStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_counts_latency_and_errors() -> None:
    clock = FakeClock()
    stats = ServingStats(window=1000, clock=clock)
    for ms in range(1, 101):  # 1 ms .. 100 ms
        started = stats.begin()
        assert stats.in_flight == 1
        clock.now += ms / 1000
        stats.end(started, "INVALID_ARGUMENT" if ms % 10 == 0 else None)
    summary = stats.latency()
    assert stats.requests == 100 and stats.in_flight == 0
    assert stats.errors == {"INVALID_ARGUMENT": 10}
    assert summary.count == 100
    assert summary.p50_ms == pytest.approx(50.5)
    assert summary.p99_ms == pytest.approx(99.01)
    assert summary.max_ms == pytest.approx(100.0)
    assert stats.uptime_s == pytest.approx(sum(range(1, 101)) / 1000)


def test_window_keeps_only_recent_calls() -> None:
    clock = FakeClock()
    stats = ServingStats(window=10, clock=clock)
    for ms in [1000] * 10 + [1] * 10:
        started = stats.begin()
        clock.now += ms / 1000
        stats.end(started)
    assert stats.latency().max_ms == pytest.approx(1.0)
    assert stats.latency().count == 10
