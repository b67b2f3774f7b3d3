"""Network faults as code, one helper each, for the hosts tier and its perf scenario. Each is
a context manager on a lab host (perf.hosts): its rules live in that host's namespace (so
deleting the namespace removes them too) and are removed when the block ends.

  blackhole(host)              every packet in and out dropped: no RST, no FIN
  partition(host, peer)        host and peer cannot reach each other; everyone else can
  loss(host, 0.05)             5% of the packets into host dropped at random
  delay(lab, host, 0.05)       host's TCP replies held 50 ms (NFQUEUE to perf.delayq)
  rate(host, "1mbit")          host's outgoing rate limited (tc tbf)
  readdress(host, ip)          host's address replaced (a pod rescheduled)
  reaches(host, peer)          whether host can open a TCP connection to peer's server port

Record set changes are `Lab.set_records`; a balancer restart is its Process's kill and a
new `Lab.balancer`."""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from perf.hosts import PORT, Host, Lab

QUEUE = 7  # the NFQUEUE number a delayed host's packets go to
BOUND_S = 15.0  # how long perf.delayq may take to start and bind its queue


def first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The first line `proc` writes to its stdout pipe, "" when none comes within
    `timeout_s` (a line is written whole, so once readable, readline does not block)."""
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        return ""
    return proc.stdout.readline()


def _rules(host: Host, rules: list[list[str]]) -> Iterator[None]:
    """Append `rules` (iptables arguments after the chain) in host's namespace for the block."""
    added: list[list[str]] = []
    try:
        for rule in rules:
            host.run("iptables", "-w", "-A", *rule)
            added.append(rule)
        yield
    finally:
        for rule in reversed(added):
            host.run("iptables", "-w", "-D", *rule, check=False)


@contextmanager
def blackhole(host: Host) -> Iterator[None]:
    yield from _rules(
        host, [["INPUT", "-i", "eth0", "-j", "DROP"], ["OUTPUT", "-o", "eth0", "-j", "DROP"]]
    )


@contextmanager
def partition(host: Host, peer: Host) -> Iterator[None]:
    """Drops between `host` and `peer` only, both ways: an asymmetric partition where the
    rest of the lab (a client) still reaches `host`."""
    yield from _rules(
        host,
        [["INPUT", "-s", peer.ip, "-j", "DROP"], ["OUTPUT", "-d", peer.ip, "-j", "DROP"]],
    )


@contextmanager
def loss(host: Host, probability: float) -> Iterator[None]:
    random = ["-m", "statistic", "--mode", "random", "--probability", f"{probability}"]
    yield from _rules(host, [["INPUT", "-i", "eth0", *random, "-j", "DROP"]])


@contextmanager
def delay(lab: Lab, host: Host, seconds: float) -> Iterator[None]:
    """Every TCP segment the host sends from the server port held `seconds` by a reader in
    its namespace (this kernel has no netem). --queue-bypass: with no reader, no hold."""
    reader = subprocess.Popen(
        host.exec_argv([sys.executable, "-m", "perf.delayq", str(QUEUE), str(seconds)]),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lab.others.append(reader)
    try:
        if first_line(reader, BOUND_S).strip() != "bound":  # bound to its queue: rules may go in
            raise RuntimeError(f"perf.delayq did not bind its queue within {BOUND_S} s")
        rule = ["OUTPUT", "-o", "eth0", "-p", "tcp", "--sport", str(PORT)]
        queue = ["-j", "NFQUEUE", "--queue-num", str(QUEUE), "--queue-bypass"]
        yield from _rules(host, [[*rule, *queue]])
    finally:
        reader.kill()
        reader.communicate(timeout=30)


@contextmanager
def rate(host: Host, limit: str) -> Iterator[None]:
    host.run(
        "tc",
        "qdisc",
        "add",
        "dev",
        "eth0",
        "root",
        "tbf",
        "rate",
        limit,
        "burst",
        "32kbit",
        "latency",
        "400ms",
    )
    try:
        yield
    finally:
        host.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)


def readdress(host: Host, ip: str) -> None:
    """The host's address replaced by `ip` (what listened on the old one must be gone)."""
    # The old one goes first: deleting a subnet's primary address deletes the others too.
    host.run("ip", "addr", "del", f"{host.ip}/24", "dev", "eth0")
    host.run("ip", "addr", "add", f"{ip}/24", "dev", "eth0")
    host.ip = ip


def reaches(host: Host, peer: Host, timeout_s: float = 1.0) -> bool:
    connect = f"exec 3<>/dev/tcp/{peer.ip}/{PORT}"
    done = host.run("timeout", str(timeout_s), "bash", "-c", connect, check=False)
    return done.returncode == 0
