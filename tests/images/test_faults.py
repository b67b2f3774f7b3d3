"""Faults made through the engine under a steady load of several callers through the
balancer (perf.hostload, run on this host against the balancer's address): a server killed,
paused (its cgroup frozen: it holds its connections and answers nothing) and cut off its
network. Each must meet the hosts tier's counts: the server out of routing within 2 s of the
fault, 0 failed calls that start after that, calls in flight at the fault there to count, and
none held past its deadline. Each test puts the server back and waits for it to be healthy
again; the next load waits for the balancer to report three backends serving."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.images.cluster import ALIAS, Cluster
from tests.images.engine import REPO

pytestmark = pytest.mark.images

OUT_OF_ROUTING_S = 2.0
FAULT_AT_S, LOAD_S = 2.0, 8.0
DEADLINE_S = 1.0
# A call's latency past its deadline that still counts as ended by it: the client's own
# timer firing on a loaded two-core machine.
LATE_S = 0.5

Fault = Callable[[Cluster, str], object]
FAULTS: dict[str, tuple[Fault, Fault]] = {
    "kill": (
        lambda c, s: c.engine.docker("kill", s),
        lambda c, s: c.engine.docker("start", s),
    ),
    "pause": (
        lambda c, s: c.engine.docker("pause", s),
        lambda c, s: c.engine.docker("unpause", s),
    ),
    "disconnect": (
        lambda c, s: c.engine.docker("network", "disconnect", c.network, s),
        lambda c, s: c.engine.docker("network", "connect", "--alias", ALIAS, c.network, s),
    ),
}


def loaded(
    containers: Cluster, out: Path, fault: Callable[[], object]
) -> tuple[float, float, list[list[Any]]]:
    """Run `fault` FAULT_AT_S into the load; when the engine was asked for it and when it
    answered (monotonic), and the load's records: [start, latency, status, node] per call."""
    argv = [sys.executable, "-m", "perf.hostload", "--target", containers.target, "--callers", "4"]
    argv += ["--seconds", str(LOAD_S), "--timeout", str(DEADLINE_S), "--ready", "3"]
    argv += ["--out", str(out)]
    with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True) as load:
        try:
            assert load.stdout is not None
            line = load.stdout.readline()  # hostload exits, ending it, if never ready
            assert line.startswith("started "), f"the load did not start: {line!r}"
            time.sleep(max(0.0, float(line.split()[1]) + FAULT_AT_S - time.monotonic()))
            # CLOCK_MONOTONIC: one clock for the load's process and ours.
            asked = time.monotonic()
            fault()
            done = time.monotonic()
            assert load.wait(LOAD_S + 60) == 0
        finally:
            if load.poll() is None:
                load.kill()
    return asked, done, json.loads(out.read_text())["records"]


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_a_server_fault_under_load(containers: Cluster, kind: str, tmp_path: Path) -> None:
    make, undo = FAULTS[kind]
    victim = containers.servers[0]
    try:
        asked, at, records = loaded(
            containers, tmp_path / "load.json", lambda: make(containers, victim)
        )
    finally:
        undo(containers, victim)
        containers.wait_healthy()
    settled = at + OUT_OF_ROUTING_S
    # In flight: begun before the engine answered, still running when it was asked.
    in_flight = [r for r in records if r[0] < at and r[0] + r[1] > asked]
    after = [r for r in records if r[0] >= settled]
    counts = {
        "calls": len(records),
        "fault took s": round(at - asked, 2),
        "failed": sum(r[2] != "OK" for r in records),
        "in flight while it was made": len(in_flight),
        "of them failed": sum(r[2] != "OK" for r in in_flight),
        "failed within 2 s": sum(r[2] != "OK" for r in records if asked <= r[0] < settled),
        "failed after 2 s": sum(r[2] != "OK" for r in after),
        "to it after 2 s": sum(r[3] == victim for r in after),
        "held past the deadline": sum(r[1] > DEADLINE_S + LATE_S for r in records),
    }
    print(f"\n{kind}: {counts}")
    assert any(r[3] == victim for r in records if r[0] < asked), f"{victim} took no calls: {counts}"
    assert len(after) > 20, counts
    assert in_flight, f"no call was in flight at the fault: {counts}"
    assert counts["failed after 2 s"] == 0, counts
    assert counts["to it after 2 s"] == 0, counts
    assert counts["held past the deadline"] == 0, counts
