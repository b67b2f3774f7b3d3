"""A Sluice cluster on lab hosts (perf.hosts), as users run one: servers listed under one DNS
name, balancers that find them by it, a client host driving load (perf.hostload) through one
or two balancers; and what a load saw, split by the moment a fault began. Used by the hosts
tier and by `python -m perf.hostfaults`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from perf.hosts import PORT, Host, Lab
from perf.launch import Process

# The balancer re-resolves the name every half second: a record change is seen well within
# the 2 s goal (the default, 2 s, would spend the whole goal on the wait alone).
BALANCER_FLAGS = ("--refresh-s", "0.5")
ROOT = Path(__file__).resolve().parents[1]
CALL_TIMEOUT = 1.0  # each call's deadline, seconds


class Call(NamedTuple):
    start: float  # time.monotonic() when it was sent
    latency: float
    status: str
    node: str  # the server that answered (x-node-id)


View = dict[str, list[Any]]  # a balancer's backends: address -> [health, breaker, calls]


@dataclass
class Seen:
    """What one load saw: its calls by start, and the first balancer's view over time."""

    t0: float
    calls: list[Call]
    samples: list[tuple[float, View]]

    def between(self, start: float, end: float = float("inf")) -> list[Call]:
        return [c for c in self.calls if start <= c.start < end]

    def failed(self, calls: Sequence[Call]) -> list[Call]:
        return [c for c in calls if c.status != "OK"]

    def first(self, after: float, condition: Callable[[View], bool]) -> float | None:
        """Seconds from `after` to the first sample of the balancer's view that meets
        `condition`."""
        for at, view in self.samples:
            if at >= after and condition(view):
                return at - after
        return None

    def last_answer_from(self, node: str, after: float) -> float | None:
        """Seconds from `after` to the start of the last call `node` answered."""
        starts = [c.start for c in self.calls if c.node == node and c.start >= after]
        return max(starts) - after if starts else None

    def first_answer_from(self, node: str, after: float) -> float | None:
        starts = [c.start for c in self.calls if c.node == node and c.start >= after]
        return min(starts) - after if starts else None


def p99(calls: Sequence[Call]) -> float:
    ok = [c.latency for c in calls if c.status == "OK"]
    return float(np.percentile(ok, 99)) if ok else float("nan")


def share(calls: Sequence[Call], node: str) -> float:
    return sum(c.node == node for c in calls) / len(calls) if calls else 0.0


def out_of(address: str) -> Callable[[View], bool]:
    """The balancer no longer routes to `address` (gone, not serving, or its breaker open)."""

    def condition(view: View) -> bool:
        state = view.get(address)
        return state is None or state[0] != "SERVING" or state[1] == "OPEN"

    return condition


def back_in(address: str) -> Callable[[View], bool]:
    def condition(view: View) -> bool:
        state = view.get(address)
        return state is not None and state[0] == "SERVING" and state[1] == "CLOSED"

    return condition


class Load:
    """A load running on the client host; `seen` waits for its end (bounded)."""

    def __init__(self, client: Host, argv: Sequence[str], out: Path, seconds: float) -> None:
        self.out = out
        self.seconds = seconds
        self.proc = subprocess.Popen(
            client.exec_argv(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,  # where `perf` imports from: it is not installed
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: --ready-s, then it exits
        if not line.startswith("started "):
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            raise RuntimeError(f"the load did not start: {err[-2000:]}")
        self.t0 = float(line.split()[1])

    def seen(self) -> Seen:
        try:
            _, err = self.proc.communicate(timeout=self.seconds + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate(timeout=30)
            raise
        if self.proc.returncode != 0:
            raise RuntimeError(f"the load failed ({self.proc.returncode}): {err[-2000:]}")
        found = json.loads(self.out.read_text())
        calls = sorted(Call(*c) for c in found["records"])
        samples = [(float(at), view) for at, view in found["samples"]]
        return Seen(found["t0"], calls, samples)


@dataclass
class Cluster:
    lab: Lab
    workdir: Path
    servers: list[Host]
    balancers: list[Host]
    client: Host
    procs: dict[str, Process] = field(default_factory=dict)
    _loads: int = 0

    @classmethod
    def make(
        cls, lab: Lab, workdir: Path, servers: int = 3, spare: int = 0, balancers: int = 1
    ) -> Cluster:
        """`servers` serving under the name (and `spare` more started but not listed yet),
        `balancers` finding them by it, and a client host."""
        hosts = [lab.add(f"s{i}") for i in range(servers + spare)]
        fronts = [lab.add(f"b{i}") for i in range(balancers)]
        cluster = cls(lab, workdir, hosts, fronts, lab.add("client"))
        lab.start_dns([h.ip for h in hosts[:servers]])
        with ThreadPoolExecutor(len(hosts)) as pool:  # each waits for its model to load
            started = list(pool.map(lambda h: lab.server(h), hosts))
        cluster.procs.update({h.name: p for h, p in zip(hosts, started, strict=True)})
        for front in fronts:
            cluster.start_balancer(front)
        return cluster

    def start_balancer(self, host: Host) -> Process:
        self.procs[host.name] = self.lab.balancer(host, *BALANCER_FLAGS)
        return self.procs[host.name]

    def address(self, host: Host) -> str:
        return f"{host.ip}:{PORT}"

    def load(
        self,
        seconds: float,
        *,
        callers: int = 8,
        ready: int = 3,
        targets: Sequence[Host] = (),
    ) -> Load:
        """Load through `targets` (default: the first balancer), begun once the first of
        them reports `ready` backends serving."""
        self._loads += 1
        out = self.workdir / f"load{self._loads}.json"
        argv = [sys.executable, "-m", "perf.hostload", "--out", str(out)]
        argv += ["--callers", str(callers), "--seconds", str(seconds)]
        argv += ["--timeout", str(CALL_TIMEOUT), "--ready", str(ready)]
        for host in targets or self.balancers[:1]:
            argv += ["--target", self.address(host)]
        return Load(self.client, argv, out, seconds)


def sleep_until(moment: float) -> None:
    """A fault's schedule under load (the load runs on its own clock, in another process)."""
    time.sleep(max(0.0, moment - time.monotonic()))
