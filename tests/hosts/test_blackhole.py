"""A server whose host drops every packet (no RST, no FIN) under load: out of routing within
2 s, then no call fails; the calls in flight at the fault end by their deadline."""

from __future__ import annotations

import time

import pytest

from perf import netfaults
from perf.hostcluster import CALL_TIMEOUT, Cluster, out_of, sleep_until

pytestmark = pytest.mark.hosts


def test_blackholed_server_leaves_routing(cluster: Cluster) -> None:
    victim = cluster.servers[0]
    load = cluster.load(seconds=7.0)
    sleep_until(load.t0 + 2.0)
    with netfaults.blackhole(victim):
        fault = time.monotonic()
        seen = load.seen()
    out = seen.first(fault, out_of(cluster.address(victim)))
    assert out is not None and out < 2.0, f"still routed to after {out} s"
    after = seen.between(fault + 2.0)
    assert len(after) > 100
    assert seen.failed(after) == []
    assert max(c.latency for c in seen.calls) < CALL_TIMEOUT + 0.5  # none hangs past it
    in_flight = [c for c in seen.between(0, fault) if c.start + c.latency > fault]
    assert in_flight, "no call was in flight at the fault"
