"""A lossy link and a slow one under load: no call fails, and once the balancer avoids the
bad server the p99 is back near the healthy one measured in the same run."""

from __future__ import annotations

import time

import pytest

from perf import netfaults
from perf.hostcluster import Cluster, p99, share, sleep_until

pytestmark = pytest.mark.hosts


def test_five_percent_loss_fails_nothing(cluster: Cluster) -> None:
    victim = cluster.servers[0]
    load = cluster.load(seconds=9.0)
    sleep_until(load.t0 + 3.0)
    with netfaults.loss(victim, 0.05):
        fault = time.monotonic()
        seen = load.seen()
    assert seen.failed(seen.calls) == []
    healthy = p99(seen.between(seen.t0 + 0.5, fault))
    avoided = p99(seen.between(fault + 2.0))
    assert avoided < 2 * healthy, f"p99 {avoided * 1e3:.1f} ms, healthy {healthy * 1e3:.1f} ms"


def test_fifty_ms_delay_loses_its_share(cluster: Cluster) -> None:
    victim = cluster.servers[0]
    load = cluster.load(seconds=9.0)
    sleep_until(load.t0 + 3.0)
    with netfaults.delay(cluster.lab, victim, 0.05):
        fault = time.monotonic()
        seen = load.seen()
    assert seen.failed(seen.calls) == []
    before = seen.between(seen.t0 + 0.5, fault)
    after = seen.between(fault + 2.0)
    assert share(after, victim.name) < share(before, victim.name) / 3
    assert p99(after) < 1.5 * p99(before), f"{p99(after) * 1e3:.1f} vs {p99(before) * 1e3:.1f} ms"
