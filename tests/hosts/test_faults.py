"""Network faults under a steady load of 8 callers (1 s deadlines) on a cluster found through
DNS: the scenarios of `python -m perf.hostfaults`, each held to the goals of its fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from perf.hostcluster import CALL_TIMEOUT, p99, share
from perf.hostfaults import SETTLE_S, Run, run_in
from perf.hosts import Lab

pytestmark = pytest.mark.hosts

CALLERS = 8  # perf.hostcluster's load


def routed_around(run: Run) -> None:
    """Out of routing within 2 s, no call begun after that fails, none hangs past its
    deadline, and the calls in flight at the fault were there to count."""
    out = run.out_s()
    assert out is not None and out < SETTLE_S, f"still routed to {out} s after the fault"
    assert len(run.after) > 100
    assert run.seen.failed(run.after) == []
    assert max(c.latency for c in run.seen.calls) < CALL_TIMEOUT + 0.5
    in_flight = [c for c in run.before if c.start + c.latency > run.fault]
    assert in_flight, "no call was in flight at the fault"
    assert run.seen.last_answer_from(run.victim, run.fault + SETTLE_S) is None


def test_blackholed_server_leaves_routing(lab: Lab, tmp_path: Path) -> None:
    routed_around(run_in(lab, tmp_path, "blackhole"))


def test_partitioned_server_leaves_routing(lab: Lab, tmp_path: Path) -> None:
    """The balancer cannot reach the server; the client host still can."""
    run = run_in(lab, tmp_path, "partition")
    assert run.moments["client reached the server"] == 1.0
    routed_around(run)


P99_FLOOR_S = 0.05  # a healthy p99 on these hosts is 15-55 ms
DELAY_FLOOR_S = 0.025  # x 1.5: below the 50 ms delay's own p99


def test_five_percent_loss_fails_nothing(lab: Lab, tmp_path: Path) -> None:
    run = run_in(lab, tmp_path, "loss")
    assert run.seen.failed(run.seen.calls) == []
    healthy, lossy = run.before, run.after
    assert lossy and healthy
    # Below the floor a doubling is this machine's noise, not the fault: a missed segment's
    # retransmission, what 5% loss costs when not avoided, is 200 ms or more.
    assert p99(lossy) < 2 * max(p99(healthy), P99_FLOOR_S), (p99(lossy), p99(healthy))


def test_fifty_ms_delay_loses_its_share(lab: Lab, tmp_path: Path) -> None:
    run = run_in(lab, tmp_path, "delay")
    assert run.seen.failed(run.seen.calls) == []
    out = run.out_s()
    assert out is not None and out < SETTLE_S, f"ejected {out} s after the delay began"
    assert share(run.after, run.victim) < share(run.before, run.victim) / 3
    # A slow probe after each cooldown ejects it again (sluice.routing.pool), so the slow
    # server's calls are too few to be the p99 (11-14 ms here; 57-62 when each probe let
    # ~20 slow calls follow). The floor is half the delay: noise below it, the fault above.
    # Measured against the other servers' calls in the same stretch, not against the calls
    # before the delay: a loaded machine's p99 moves 25-50 ms from one stretch to the next,
    # and a noisier stretch after than before read as the slow server's calls.
    others = [c for c in run.after if c.node != run.victim]
    slow = [round(c.latency, 3) for c in run.after if c.node == run.victim]
    assert p99(run.after) < 1.5 * max(p99(others), DELAY_FLOOR_S), (
        p99(run.after),
        p99(others),
        f"{len(slow)} of {len(run.after)} calls to {run.victim}: {slow[:40]}",
    )


def test_scale_three_to_five_to_two(lab: Lab, tmp_path: Path) -> None:
    run = run_in(lab, tmp_path, "scale")
    assert run.seen.failed(run.seen.calls) == []
    joined = run.in_s()
    assert joined is not None and joined < SETTLE_S, f"new servers answered {joined} s after"
    down = run.moments["down"]
    for gone in ("s0", "s1", "s2"):
        last = run.seen.last_answer_from(gone, down)
        assert last is None or last < SETTLE_S, f"{gone} still took calls {last} s after"
    assert len(run.seen.between(down + SETTLE_S)) > 100


def test_address_change_rejoins(lab: Lab, tmp_path: Path) -> None:
    run = run_in(lab, tmp_path, "readdress")
    assert run.fault < run.seen.t0 + 7.0, "the server took too long to restart for the test"
    assert run.seen.failed(run.seen.calls) == []
    back = run.in_s()
    assert back is not None and back < SETTLE_S, f"rejoined {back} s after the record change"


def test_balancer_killed_with_two_given(lab: Lab, tmp_path: Path) -> None:
    run = run_in(lab, tmp_path, "balancer-kill")
    failed = run.seen.failed(run.seen.calls)
    # Only calls begun before the kill, at most one per caller, were in flight on it.
    assert all(c.start < run.fault for c in failed), failed
    assert len(failed) <= CALLERS
    assert len(run.seen.between(run.fault)) > 100


def test_balancer_blackholed_with_two_given(lab: Lab, tmp_path: Path) -> None:
    run = run_in(lab, tmp_path, "balancer-blackhole")
    failed = run.seen.failed(run.seen.calls)
    assert all(c.start < run.fault for c in failed), failed
    assert len(failed) <= CALLERS
