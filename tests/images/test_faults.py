"""Faults made through the engine under a steady load of several callers through the
balancer (perf.hostload, run on this host against the balancer's address): a server killed,
paused (its cgroup frozen: it holds its connections and answers nothing) and cut off its
network. Each must meet the hosts tier's counts: the server out of routing within 2 s of the
fault, 0 failed calls that start after that, calls in flight at the fault there to count, and
none held past its deadline. The fault's moment is when the engine reports it done (its
event: the server died, was frozen, was cut off), not when the engine answered the command:
under load `docker kill` answers seconds after the server died (it tears the network down
first), and the balancer's 2 s run from the death. Each test puts the server back
and waits for it to be healthy again; the next load waits for the balancer to report three
backends serving."""

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
# The engine's event that says each fault has taken effect, and whose attribute names the
# container (a network event's actor is the network).
EFFECT = {
    "kill": ("container", "die"),
    "pause": ("container", "pause"),
    "disconnect": ("network", "disconnect"),
}
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
) -> tuple[float, float, dict[str, Any]]:
    """Run `fault` FAULT_AT_S into the load; when the engine was asked for it and when it
    answered (monotonic), and the load's output: its records, [start, latency, status, node]
    per call, and its samples of the balancer's view."""
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
    found: dict[str, Any] = json.loads(out.read_text())
    return asked, done, found


def took_effect(containers: Cluster, kind: str, victim: str, asked: float) -> list[float]:
    """When (monotonic) the engine's events since `asked` say `kind` took effect on
    `victim`. The engine stamps events with the wall clock of this host; the offset to the
    monotonic clock is read once, and moves by far less than a millisecond in a test."""
    offset = time.time() - time.monotonic()
    kind_type, action = EFFECT[kind]
    ident = containers.inspect(victim)["Id"]
    listed = containers.engine.docker(
        "events",
        "--since",
        f"{asked + offset - 1:.3f}",
        "--until",
        f"{time.time():.3f}",
        "--filter",
        f"type={kind_type}",
        "--filter",
        f"event={action}",
        "--format",
        "{{.TimeNano}} {{.Actor.ID}} {{.Actor.Attributes.container}}",
    )
    return [
        int(nano) / 1e9 - offset
        for nano, *who in (line.split() for line in listed.splitlines())
        if ident in who
    ]


def explain(
    records: list[list[Any]], samples: list[Any], moments: dict[str, float], failed: list[Any]
) -> str:
    """The failed calls and the balancer's view as it changed, in seconds from the moment
    the engine was asked for the fault: what a failure needs to explain itself."""
    asked = moments["asked"]
    lines = [" ".join(f"{k} {v - asked:+.3f}" for k, v in moments.items())]
    lines += [f"call at {r[0] - asked:+.3f}: {r[1]:.3f} s {r[2]} from {r[3]!r}" for r in failed]
    last = None
    for at, view in samples:
        states = {address: tuple(state[:2]) for address, state in view.items()}
        if states != last:
            lines.append(f"balancer at {at - asked:+.3f}: {states}")
            last = states
    return "\n".join(lines)


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_a_server_fault_under_load(containers: Cluster, kind: str, tmp_path: Path) -> None:
    make, undo = FAULTS[kind]
    victim = containers.servers[0]
    made: list[bool] = []  # undone only if asked for: else undo's error hides the first

    def fault() -> None:
        made.append(True)
        make(containers, victim)

    try:
        asked, at, found = loaded(containers, tmp_path / "load.json", fault)
        effects = took_effect(containers, kind, victim, asked)
    finally:
        if made:
            undo(containers, victim)
        containers.wait_healthy()
    records, samples = found["records"], found["samples"]
    assert effects, f"the engine reported no {EFFECT[kind]} of {victim} after the fault"
    # Between asking and the answer: the event is stamped once the engine has done it.
    effect = min(max(effects[0], asked), at)
    settled = effect + OUT_OF_ROUTING_S
    # In flight: begun before the fault took effect, still running when it was asked.
    in_flight = [r for r in records if r[0] < effect and r[0] + r[1] > asked]
    after = [r for r in records if r[0] >= settled]
    counts = {
        "calls": len(records),
        "fault took s": round(at - asked, 2),
        "took effect at s": round(effect - asked, 2),
        "failed": sum(r[2] != "OK" for r in records),
        "in flight while it was made": len(in_flight),
        "of them failed": sum(r[2] != "OK" for r in in_flight),
        "failed within 2 s": sum(r[2] != "OK" for r in records if asked <= r[0] < settled),
        "failed after 2 s": sum(r[2] != "OK" for r in after),
        "to it after 2 s": sum(r[3] == victim for r in after),
        "held past the deadline": sum(r[1] > DEADLINE_S + LATE_S for r in records),
    }
    print(f"\n{kind}: {counts}")
    moments = {"asked": asked, "took effect": effect, "answered": at, "settled": settled}

    def why(bad: list[Any]) -> str:
        return f"{counts}\n{explain(records, samples, moments, bad)}"

    assert any(r[3] == victim for r in records if r[0] < asked), f"{victim} took no calls: {counts}"
    assert len(after) > 20, counts
    assert in_flight, f"no call was in flight at the fault: {counts}"
    assert counts["failed after 2 s"] == 0, why([r for r in after if r[2] != "OK"])
    assert counts["to it after 2 s"] == 0, why([r for r in after if r[3] == victim])
    held = [r for r in records if r[1] > DEADLINE_S + LATE_S]
    assert counts["held past the deadline"] == 0, why(held)
