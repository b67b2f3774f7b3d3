"""The target's CPU for `sluice perf`: real listening processes found by their port through
/proc, and their CPU time read as it grows."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from sluice.perf import report, target

# A listener on HOST:PORT (port 0: a free one; SO_REUSEPORT, so a second can share it) that
# prints its port, then, for each connection, burns the CPU seconds it is sent (bounded by
# its own CPU clock, so the amount is the same however busy the machine is) and answers.
LISTENER = r"""
import socket, sys, time
host, port, spawn = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "spawn"
if spawn:  # a parent holding no socket, its child the listener; it lives on after the child
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", sys.argv[4], host, str(port), "no", ""])
    child.wait()
    time.sleep(120)
    sys.exit()
family = socket.AF_INET6 if ":" in host else socket.AF_INET
s = socket.socket(family, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind((host, port))
s.listen()
print(s.getsockname()[1], flush=True)
while True:
    conn, _ = s.accept()
    seconds = float(conn.recv(64))
    start, deadline = time.process_time(), time.monotonic() + 60
    while time.process_time() - start < seconds and time.monotonic() < deadline:
        pass
    conn.sendall(b"done")
    conn.close()
"""


@contextmanager
def listener(
    host: str = "127.0.0.1", port: int = 0, spawn: bool = False
) -> Iterator[tuple[int, int]]:
    """(pid, port) of a listener started for the block; stopped by its pid after it."""
    argv = [sys.executable, "-c", LISTENER, host, str(port), "spawn" if spawn else "no", LISTENER]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        # The child prints it through the inherited pipe; bounded, so a hung start fails.
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the listener printed no port within 30 s"
        line = proc.stdout.readline()
        assert line.strip().isdigit(), "the listener did not start"
        yield proc.pid, int(line)
    finally:
        for pid in target.descendants([proc.pid]):
            subprocess.run(["kill", str(pid)], check=False)
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def burn(port: int, seconds: float, host: str = "127.0.0.1") -> None:
    with socket.create_connection((host, port), timeout=60) as conn:
        conn.sendall(str(seconds).encode())
        assert conn.recv(4) == b"done"


def test_find_pids_finds_the_listener_and_its_cpu_grows_when_it_works() -> None:
    with listener() as (pid, port):
        assert target.find_pids("127.0.0.1", port) == [pid]
        assert target.find_pids("localhost", port) == [pid]  # the same machine by name
        with socket.socket() as bound:  # bound, never listening: a port with no listener
            bound.bind(("127.0.0.1", 0))
            assert target.find_pids("127.0.0.1", bound.getsockname()[1]) == []
        before = target.cpu_seconds([pid])
        burn(port, 0.3)
        # It used 0.3 s by its own clock; /proc counts in ticks (1/100 s).
        assert target.cpu_seconds([pid]) - before >= 0.28


def test_a_listener_on_ipv6_loopback_is_found() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no ::1 here")
    with listener("::1") as (pid, port):
        assert target.find_pids("::1", port) == [pid]
        assert target.processes([f"[::1]:{port}"], []).roots == (pid,)  # type: ignore[union-attr]


def test_workers_sharing_a_port_are_all_found_and_summed() -> None:
    with listener() as (first, port), listener(port=port) as (second, _):
        procs = target.processes([f"127.0.0.1:{port}"], [])
        assert isinstance(procs, target.Processes)
        assert procs.roots == tuple(sorted([first, second]))
        meter = target.Meter(procs)
        meter.start()
        burn(port, 0.2)  # the kernel picks one of the two
        burn(port, 0.2)
        meter.stop()
        level = meter.figures(calls=2, wall_s=1.0)
        assert isinstance(level, dict), level
        assert level["cpu_s"] >= 0.38  # type: ignore[operator]
        assert level["per_call_ms"] >= 190  # type: ignore[operator]
        assert level["found"] == f"listening on port {port}"
        assert level["pids"] == sorted([first, second]) and level["children"] == []


def test_a_given_pids_children_count_even_after_they_exit() -> None:
    with listener(spawn=True) as (parent, port):
        (child,) = target.find_pids("127.0.0.1", port)  # the parent holds no socket
        assert child != parent
        given = target.processes([f"127.0.0.1:{port}"], [parent])
        assert isinstance(given, target.Processes)
        assert given.roots == (parent,) and given.found == f"--target-pid {parent}"
        meter = target.Meter(given)
        meter.start()
        burn(port, 0.3)
        subprocess.run(["kill", str(child)], check=True)
        # The parent reaps it (then its CPU is the parent's cutime); bounded wait.
        deadline = time.monotonic() + 30
        while target.descendants([parent]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert target.descendants([parent]) == []
        meter.stop()
        level = meter.figures(calls=1, wall_s=1.0)
        assert isinstance(level, dict), level
        assert level["cpu_s"] >= 0.28  # type: ignore[operator]
        assert level["pids"] == [parent] and level["children"] == []


def test_the_sweeps_own_process_is_not_the_targets() -> None:
    # --target-pid of the shell that runs the sweep: the sweep and its load are left out.
    with listener() as (pid, _):
        above = target.descendants([os.getppid()])
        assert os.getpid() not in above and pid not in above
        assert pid in target.descendants([os.getpid()])  # below a root, as usual


def test_a_target_that_is_not_local_or_a_pid_that_is_gone_gives_a_reason() -> None:
    # 192.0.2.1 is a documentation address: no machine of ours has it.
    assert "not this machine" in str(target.processes(["192.0.2.1:8001"], []))
    assert "not this machine" in str(target.processes(["dns:///somewhere"], []))
    with listener() as (pid, port):
        procs = target.processes([f"127.0.0.1:{port}"], [])
        assert isinstance(procs, target.Processes)
        meter = target.Meter(procs)
        meter.start()
    # The block stopped it (and waited for it): the level has no figure, only a reason.
    meter.stop()
    assert meter.figures(calls=10, wall_s=1.0) == f"target pid {pid} gone during the level"
    assert "no process of this user listens" in str(target.processes([f"127.0.0.1:{port}"], []))


def test_a_level_whose_cores_are_unknown_renders() -> None:
    # A level of no wall time has a per-call figure but no cores (figures() gives None).
    level = {
        "mode": "concurrency",
        "value": 1,
        "calls": 1,
        "ok": 1,
        "statuses": {"OK": 1},
        "throughput": 0.0,
        "latency": dict.fromkeys(("min", "p50", "p90", "p99", "p999", "max"), 1.0),
        "client_cpu": 0.0,
        "client_saturated": False,
        "server": {},
        "target_cpu": {"per_call_ms": 2.5, "cores": None},
    }
    result = {"title": "t", "command": "c", "levels": [level], "knee": None, "warnings": []}
    result["target_cpu"] = "on"  # the sweep measured it
    assert "| 2.500 ms, - cores |" in report.markdown(result)
