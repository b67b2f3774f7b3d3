"""The target's own CPU time over a sweep's levels (Linux /proc): every process listening on
the target's port (each worker binds its own) or the pids given, and their descendants,
whose CPU counts in the parent's cutime after they exit. Never their ancestors (a shell, a
test runner): name a supervisor with --target-pid to count it."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}
TICK = os.sysconf("SC_CLK_TCK")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces), so field n of
    proc(5) is at n - 3; raises OSError when the process is gone."""
    fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped: its CPU no longer grows
        raise ProcessLookupError(pid)
    return fields


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of these processes so far; OSError when one is gone."""
    total = 0
    for pid in pids:
        fields = _stat(pid)
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / TICK


def start_ticks(pid: int) -> int:
    """The process's start time (field 22), so a pid taken by a new process reads as gone."""
    return int(_stat(pid)[19])


def local_addresses(host: str) -> list[Address] | None:
    """The addresses `host` names, when all of them are this machine's; None otherwise (or
    when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None
    found = []
    for family, _, _, _, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if not (address.is_loopback or address.is_unspecified or _bindable(family, sockaddr)):
            return None
        found.append(address)
    return found or None


def _bindable(family: int, sockaddr: tuple[object, ...]) -> bool:
    """Whether this machine owns the address (only an address of its own binds)."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError:
            return False
    return True


def _address(hexed: str) -> Address:
    """/proc/net/tcp{,6}'s address: 32-bit words in the host's byte order."""
    words = [int(hexed[i : i + 8], 16) for i in range(0, len(hexed), 8)]
    address = ipaddress.ip_address(struct.pack(f"={len(words)}I", *words))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def listen_inodes(port: int, addresses: Sequence[Address]) -> set[int]:
    """Inodes of the LISTEN sockets on `port` that serve one of `addresses` (bound to it, or
    to every address)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue  # no IPv6 here
        for row in rows:
            cols = row.split()
            hexed, _, hexport = cols[1].partition(":")
            if cols[3] != LISTEN or int(hexport, 16) != port:
                continue
            bound = _address(hexed)
            if bound.is_unspecified or bound in addresses:
                inodes.add(int(cols[9]))
    return inodes


def socket_owners(inodes: set[int]) -> list[int]:
    """Processes holding one of these sockets (only this user's processes can be read)."""
    links = {f"socket:[{inode}]" for inode in inodes}
    owners = []
    for fd_dir in PROC.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) in links for fd in fd_dir.iterdir()):
                owners.append(int(fd_dir.parent.name))
        except OSError:
            continue  # another user's, or it exited while we looked
    return sorted(owners)


def find_pids(host: str, port: int) -> list[int]:
    """The local processes listening on host:port ([] when the host is not this machine's)."""
    addresses = local_addresses(host)
    if addresses is None:
        return []
    inodes = listen_inodes(port, addresses)
    return socket_owners(inodes) if inodes else []


def _table() -> dict[int, tuple[int, int]]:
    """Every process now: pid -> (parent, CPU ticks of its own and of the children it has
    reaped). Zombies count: their CPU moves to the parent's when it reaps them."""
    found = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            # ppid; utime, stime, cutime, cstime (fields 4 and 14 to 17)
            found[int(stat.parent.name)] = (int(fields[1]), sum(map(int, fields[11:15])))
        except (OSError, ValueError, IndexError):
            continue  # it exited while we looked
    return found


def descendants(pids: Iterable[int], table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """Processes below these, less this one and its own (the sweep's load is not the target's)."""
    below: dict[int, list[int]] = {}
    for pid, (parent, _) in (table or _table()).items():
        below.setdefault(parent, []).append(pid)
    roots = set(pids)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in below.get(todo.pop(), []):
            if child != os.getpid() and child not in found and child not in roots:
                found.add(child)
                todo.append(child)
    return sorted(found)


@dataclass(frozen=True)
class Processes:
    """The target: its root processes (listeners, or the pids given) with their start times,
    found how. Their descendants are taken as they are at each reading."""

    roots: tuple[int, ...]
    starts: tuple[int, ...]
    found: str

    def gone(self) -> list[int]:
        """The roots that exited (or whose pid a new process took) since they were found."""
        lost = []
        for pid, start in zip(self.roots, self.starts, strict=True):
            try:
                if start_ticks(pid) != start:
                    lost.append(pid)
            except OSError:
                lost.append(pid)
        return lost


@dataclass(frozen=True)
class Reading:
    """The target's CPU so far: the roots, their descendants now, and reaped children's."""

    pids: tuple[int, ...]
    children: tuple[int, ...]
    seconds: float

    @classmethod
    def now(cls, procs: Processes) -> Reading | None:
        """None when a root is gone."""
        table = _table()
        if procs.gone() or any(pid not in table for pid in procs.roots):
            return None
        children = descendants(procs.roots, table)
        pids = tuple(sorted({*procs.roots, *children}))
        ticks = sum(table[pid][1] for pid in pids if pid in table)
        return cls(pids, tuple(children), ticks / TICK)


def host_port(target: str) -> tuple[str, int] | None:
    """HOST and PORT of `HOST:PORT` or `[V6]:PORT`; None for another form."""
    host, _, port = target.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def processes(targets: Sequence[str], given: Sequence[int]) -> Processes | str:
    """The target's root processes now: `given` pids, or the listeners on each target's port
    (all of them: with several targets, a call's CPU is theirs together). A string says why
    there are none."""
    roots: list[int] = list(given)
    found = "--target-pid " + ",".join(map(str, given))
    if not given:
        ports = []
        for target in targets:
            parsed = host_port(target)
            if parsed is None or local_addresses(parsed[0]) is None:
                return f"{target} is not this machine: its CPU cannot be read (no target cpu/call)"
            listeners = find_pids(*parsed)
            if not listeners:
                return (
                    f"no process of this user listens on {target} (another user's cannot be "
                    "read): no target cpu/call; --target-pid PID names it"
                )
            roots += listeners
            ports.append(str(parsed[1]))
        found = "listening on port " + ",".join(ports)
    roots = sorted(set(roots))
    try:
        starts = tuple(start_ticks(pid) for pid in roots)
    except OSError:
        return f"target pid gone ({found}): no target cpu/call"
    return Processes(tuple(roots), starts, found)


class Meter:
    """The target's CPU over one level: `start()` at the end of the warm-up, `stop()` when the
    level ends, then `figures()`."""

    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.readings: list[Reading | None] = []  # None: a root was gone

    @property
    def started(self) -> bool:
        return bool(self.readings)

    def start(self) -> None:
        self.readings = [Reading.now(self.procs)]

    def stop(self) -> None:
        self.readings.append(Reading.now(self.procs))

    def figures(self, calls: int, wall_s: float) -> dict[str, object] | str:
        """The level's `target_cpu` field (per call: over `calls` answered; cores: over the
        level's `wall_s`), or why there is none."""
        lost = self.procs.gone()
        if lost or None in self.readings:
            return (
                f"target pid {','.join(map(str, lost or self.procs.roots))} gone during the level"
            )
        if len(self.readings) != 2:
            return "the level ended before its warm-up did: no target cpu/call"
        first, last = self.readings
        assert first is not None and last is not None
        spent = last.seconds - first.seconds
        return {
            "pids": list(last.pids),
            "found": self.procs.found,
            "children": list(last.children),
            "cpu_s": spent,
            "per_call_ms": spent / calls * 1000 if calls else None,
            "cores": spent / wall_s if wall_s else None,
        }
