"""The record set behind the balancer's DNS name changes under load, as a headless Service's
does when pods come and go: no call fails, new servers take calls within 2 s, removed ones
drain, and a server whose address changes rejoins within 2 s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from perf import netfaults
from perf.hostcluster import Cluster, sleep_until
from perf.hosts import SUBNET, Lab

pytestmark = pytest.mark.hosts


def test_scale_three_to_five_to_two(lab: Lab, tmp_path: Path) -> None:
    cluster = Cluster.make(lab, tmp_path, servers=3, spare=2)
    ips = [h.ip for h in cluster.servers]
    load = cluster.load(seconds=9.0)
    sleep_until(load.t0 + 2.0)
    up = time.monotonic()
    lab.set_records(ips)  # 3 -> 5
    sleep_until(load.t0 + 5.0)
    down = time.monotonic()
    lab.set_records(ips[3:])  # 5 -> 2: the first three leave
    seen = load.seen()
    assert seen.failed(seen.calls) == []
    for new in cluster.servers[3:]:
        first = seen.first_answer_from(new.name, up)
        assert first is not None and first < 2.0, f"{new.name} first answered {first} s after"
    for gone in cluster.servers[:3]:
        last = seen.last_answer_from(gone.name, down)
        assert last is None or last < 2.0, f"{gone.name} still took calls {last} s after"
    assert len(seen.between(down + 2.0)) > 100


def test_address_change_rejoins(cluster: Cluster) -> None:
    moved = cluster.servers[0]
    load = cluster.load(seconds=10.0)
    sleep_until(load.t0 + 1.0)
    assert cluster.procs[moved.name].terminate() == 0  # drained, as a pod being moved is
    netfaults.readdress(moved, f"{SUBNET}.99")
    cluster.procs[moved.name] = cluster.lab.server(moved)
    change = time.monotonic()
    cluster.lab.set_records([h.ip for h in cluster.servers])
    seen = load.seen()
    assert change < load.t0 + 7.0, "the server took too long to restart for the test"
    assert seen.failed(seen.calls) == []
    back = seen.first_answer_from(moved.name, change)
    assert back is not None and back < 2.0, f"rejoined {back} s after the record change"
