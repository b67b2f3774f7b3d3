"""`python -m perf.hostfaults`: network faults under load on hosts made of network
namespaces (perf.hosts; Linux, root, dnsmasq). Each scenario makes its own cluster (three
servers found through DNS, a balancer, a client host driving 8 callers with 1 s deadlines),
applies one fault (perf.netfaults) and prints a row of counts; the hosts tier runs the same
scenarios and asserts the issue's goals on them.

  python -m perf.hostfaults                    # every scenario, about 2 minutes
  python -m perf.hostfaults --scenario delay --scenario loss

Columns: calls and failed calls in all; failed among those begun 2 s or more after the
fault; p99 of the OK calls before the fault and from 2 s after it; the victim's share of the
calls before and after; `out s`: from the fault to the balancer's Health showing the victim
out of routing; `in s`: from a record change to the first call a new (or moved) server
answered."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from perf import netfaults
from perf.bench import table
from perf.hostcluster import Call, Cluster, Seen, out_of, p99, share, sleep_until
from perf.hosts import SUBNET, Lab, why_not

SETTLE_S = 2.0  # the goals' "within 2 s": calls begun later count as after the fault


@dataclass
class Run:
    """One scenario's load and the moments that matter in it (time.monotonic())."""

    name: str
    seen: Seen
    fault: float
    victim: str  # its node id ("" when no one server is the victim)
    address: str = ""  # the victim's, as the balancer lists it
    joining: tuple[str, ...] = ()  # servers that a record change brings in
    moments: dict[str, float] = field(default_factory=dict)

    @property
    def before(self) -> list[Call]:
        return self.seen.between(self.seen.t0 + 0.5, self.fault)

    @property
    def after(self) -> list[Call]:
        return self.seen.between(self.fault + SETTLE_S)

    def out_s(self) -> float | None:
        return self.seen.first(self.fault, out_of(self.address)) if self.address else None

    def in_s(self) -> float | None:
        """From the fault (a record change) until every joining server has answered a call."""
        firsts = [self.seen.first_answer_from(n, self.fault) for n in self.joining]
        known = [f for f in firsts if f is not None]
        return max(known) if known and len(known) == len(firsts) else None


Fault = Callable[[], AbstractContextManager[None]]


def _held(cluster: Cluster, seconds: float, at: float, name: str, fault: Fault) -> Run:
    """Load for `seconds`, the fault (a context manager) held from `at` to the end."""
    victim = cluster.servers[0]
    load = cluster.load(seconds=seconds)
    sleep_until(load.t0 + at)
    with fault():
        began = time.monotonic()
        seen = load.seen()
    return Run(name, seen, began, victim.name, cluster.address(victim))


def blackhole(cluster: Cluster) -> Run:
    return _held(cluster, 7.0, 2.0, "blackhole", lambda: netfaults.blackhole(cluster.servers[0]))


def partition(cluster: Cluster) -> Run:
    """The balancer and one server cut off from each other; the client still reaches it."""
    victim = cluster.servers[0]
    load = cluster.load(seconds=7.0)
    sleep_until(load.t0 + 2.0)
    with netfaults.partition(victim, cluster.balancers[0]):
        began = time.monotonic()
        reached = netfaults.reaches(cluster.client, victim)
        seen = load.seen()
    run = Run("partition", seen, began, victim.name, cluster.address(victim))
    run.moments["client reached the server"] = float(reached)
    return run


def loss(cluster: Cluster) -> Run:
    # A longer healthy stretch than the others: the p99 of 2.5 s of calls here varies 15-55 ms.
    return _held(cluster, 13.0, 6.0, "loss 5%", lambda: netfaults.loss(cluster.servers[0], 0.05))


def delay(cluster: Cluster) -> Run:
    def fault() -> AbstractContextManager[None]:
        return netfaults.delay(cluster.lab, cluster.servers[0], 0.05)

    return _held(cluster, 9.0, 3.0, "delay 50 ms", fault)


def rate(cluster: Cluster) -> Run:
    return _held(
        cluster, 9.0, 3.0, "rate 200kbit", lambda: netfaults.rate(cluster.servers[0], "200kbit")
    )


def scale(cluster: Cluster) -> Run:
    """3 -> 5 servers at 2 s, 5 -> 2 (the first three leave) at 5 s."""
    ips = [h.ip for h in cluster.servers]
    load = cluster.load(seconds=9.0)
    sleep_until(load.t0 + 2.0)
    up = time.monotonic()
    cluster.lab.set_records(ips)
    sleep_until(load.t0 + 5.0)
    down = time.monotonic()
    cluster.lab.set_records(ips[3:])
    joining = tuple(h.name for h in cluster.servers[3:])
    return Run("dns 3->5->2", load.seen(), up, "", joining=joining, moments={"down": down})


def readdress(cluster: Cluster) -> Run:
    """One server drained, its host given a new address, started again there, and the
    record set changed to name it."""
    moved = cluster.servers[0]
    load = cluster.load(seconds=10.0)
    sleep_until(load.t0 + 1.0)
    if cluster.procs[moved.name].terminate() != 0:
        raise RuntimeError(f"{moved.name} did not drain cleanly")
    netfaults.readdress(moved, f"{SUBNET}.99")
    cluster.procs[moved.name] = cluster.lab.server(moved)
    change = time.monotonic()
    cluster.lab.set_records([h.ip for h in cluster.servers])
    return Run("address change", load.seen(), change, moved.name, joining=(moved.name,))


def balancer_kill(cluster: Cluster) -> Run:
    """The client given two balancers; the first SIGKILLed at 2 s and started again."""
    load = cluster.load(seconds=8.0, targets=cluster.balancers)
    sleep_until(load.t0 + 2.0)
    kill = time.monotonic()
    cluster.procs[cluster.balancers[0].name].kill()
    cluster.start_balancer(cluster.balancers[0])
    return Run("balancer killed", load.seen(), kill, "")


def balancer_blackhole(cluster: Cluster) -> Run:
    """The client given two balancers; the first one's host blackholed at 2 s."""
    load = cluster.load(seconds=8.0, targets=cluster.balancers)
    sleep_until(load.t0 + 2.0)
    with netfaults.blackhole(cluster.balancers[0]):
        began = time.monotonic()
        seen = load.seen()
    return Run("balancer blackholed", seen, began, "")


@dataclass(frozen=True)
class Scenario:
    run: Callable[[Cluster], Run]
    spare: int = 0  # servers started but not yet in DNS
    balancers: int = 1


SCENARIOS = {
    "blackhole": Scenario(blackhole),
    "partition": Scenario(partition),
    "loss": Scenario(loss),
    "delay": Scenario(delay),
    "rate": Scenario(rate),
    "scale": Scenario(scale, spare=2),
    "readdress": Scenario(readdress),
    "balancer-kill": Scenario(balancer_kill, balancers=2),
    "balancer-blackhole": Scenario(balancer_blackhole, balancers=2),
}


def run_in(lab: Lab, workdir: Path, name: str) -> Run:
    """Scenario `name` on a fresh cluster in `lab`."""
    scenario = SCENARIOS[name]
    cluster = Cluster.make(
        lab, workdir, servers=3, spare=scenario.spare, balancers=scenario.balancers
    )
    return scenario.run(cluster)


def row(run: Run) -> list[str]:
    seen = run.seen

    def ms(value: float) -> str:
        return f"{value * 1e3:.1f}"

    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return [
        run.name,
        str(len(seen.calls)),
        str(len(seen.failed(seen.calls))),
        str(len(seen.failed(run.after))),
        ms(p99(run.before)),
        ms(p99(run.after)),
        f"{share(run.before, run.victim):.2f}" if run.victim else "-",
        f"{share(run.after, run.victim):.2f}" if run.victim else "-",
        s(run.out_s()),
        s(run.in_s()),
    ]


HEADERS = ["fault", "calls", "failed", "failed after", "p99 ms before", "p99 ms after"]
HEADERS += ["share before", "share after", "out s", "in s"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m perf.hostfaults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="repeatable")
    args = p.parse_args(argv)
    if reason := why_not():
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    rows = []
    for name in args.scenario or list(SCENARIOS):
        with tempfile.TemporaryDirectory(prefix=f"sluice-hostfaults-{name}-") as scratch:
            lab = Lab(Path(scratch))
            try:
                rows.append(row(run_in(lab, Path(scratch), name)))
            finally:
                lab.close()
        print(table(HEADERS, rows[-1:]), flush=True)
    print()
    print(table(HEADERS, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
