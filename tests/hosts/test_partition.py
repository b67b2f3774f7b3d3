"""The balancer cannot reach one server, while everyone else (the client, the other servers)
still can: the same goals as a blackhole."""

from __future__ import annotations

import time

import pytest

from perf import netfaults
from perf.hostcluster import CALL_TIMEOUT, Cluster, out_of, sleep_until

pytestmark = pytest.mark.hosts


def test_partitioned_server_leaves_routing(cluster: Cluster) -> None:
    victim, balancer = cluster.servers[0], cluster.balancers[0]
    load = cluster.load(seconds=7.0)
    sleep_until(load.t0 + 2.0)
    with netfaults.partition(victim, balancer):
        fault = time.monotonic()
        # The partition is one-sided: the client host still reaches the server.
        cluster.client.run("bash", "-c", f"exec 3<>/dev/tcp/{victim.ip}/7000")
        seen = load.seen()
    out = seen.first(fault, out_of(cluster.address(victim)))
    assert out is not None and out < 2.0, f"still routed to after {out} s"
    after = seen.between(fault + 2.0)
    assert len(after) > 100
    assert seen.failed(after) == []
    assert max(c.latency for c in seen.calls) < CALL_TIMEOUT + 0.5
    assert seen.last_answer_from(victim.name, fault + 2.0) is None
