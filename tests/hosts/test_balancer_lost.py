"""A client given two balancers, one killed under load and started again: no call fails but
those in flight on the killed one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from perf.hostcluster import Cluster, sleep_until
from perf.hosts import Lab

pytestmark = pytest.mark.hosts

CALLERS = 8


def test_balancer_killed_with_two_given(lab: Lab, tmp_path: Path) -> None:
    cluster = Cluster.make(lab, tmp_path, servers=3, balancers=2)
    killed = cluster.balancers[0]
    load = cluster.load(seconds=8.0, callers=CALLERS, targets=cluster.balancers)
    sleep_until(load.t0 + 2.0)
    kill = time.monotonic()
    cluster.procs[killed.name].kill()
    cluster.start_balancer(killed)
    seen = load.seen()
    failed = seen.failed(seen.calls)
    # Only calls begun before the kill, at most one per caller, can have been on it then.
    assert all(c.start < kill for c in failed), failed
    assert len(failed) <= CALLERS
    assert len(seen.between(kill)) > 100
