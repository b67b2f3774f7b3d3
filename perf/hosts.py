"""Hosts on one machine: network namespaces joined by veth pairs to a bridge, with private
addresses that exist only inside them, a dnsmasq answering `servers.<domain>` from a record
file it re-reads on SIGHUP, and the real Sluice commands started in them (`ip netns exec`).

The bridge lives in a namespace of its own (the switch), so the machine's own interfaces,
routes and firewall are never touched: deleting the namespaces removes every link, address
and iptables rule made here. Names carry a per-run prefix (`PREFIX`, the owner's pid, a random
tag) so runs never clash; `leftovers` finds anything a run left behind, and `remove_stale`
removes what runs whose owner has died left."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from perf.launch import BIN, Process

PREFIX = "slh"  # every namespace, link and /etc/netns folder a lab makes starts with it
SUBNET = "10.213.0"  # a /24 that exists only inside the lab's namespaces
DNS_IP = f"{SUBNET}.2"
DOMAIN = "sluice.test"
PORT = 7000  # every server listens on it (one name, one port, as in a headless Service)
NETNS_ETC = Path("/etc/netns")  # `ip netns exec` bind-mounts NAME/resolv.conf from here
NETNS_RUN = Path("/run/netns")  # where `ip netns add` mounts each namespace
WAIT_S = 10.0  # how long a killed process may take to go
OWNER = re.compile(rf"^{PREFIX}(\d+)x")  # the owner's pid in a run prefix's names


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A short command (ip, iptables, tc), bounded; its stderr in the error when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def why_not() -> str:
    """Why hosts cannot be made here ("" when they can)."""
    if not sys.platform.startswith("linux"):
        return "the hosts tier needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the hosts tier needs root (ip netns add)"
    for tool in ("ip", "iptables", "tc", "dnsmasq"):
        if shutil.which(tool) is None:
            return f"the hosts tier needs {tool} (apt-get install iproute2 iptables dnsmasq-base)"
    probe = f"{PREFIX}probe{os.getpid()}"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return "network namespaces cannot be made here (ip netns add failed)"
    sh("ip", "netns", "del", probe, check=False)
    return ""


def netns_names() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def run_prefix() -> str:
    """A prefix for this process's labs: the owner's pid tells a crashed run's names from a
    live run's (`remove_stale`)."""
    return f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"


def netns_inode(name: str) -> int:
    return (NETNS_RUN / name).stat().st_ino


def processes_in(inodes: set[int]) -> list[int]:
    """The pids of the processes whose network namespace is one of `inodes` (deleted or not:
    a process keeps its namespace alive after `ip netns del`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone, or not ours to look at
                if (entry / "ns" / "net").stat().st_ino in inodes:
                    found.append(int(entry.name))
    return found


def leftovers(prefix: str = PREFIX, inodes: Iterable[int] = ()) -> list[str]:
    """What labs with `prefix` left on this machine: namespaces, links in the machine's own
    namespace, /etc/netns folders, processes in those namespaces or in the namespaces of
    `inodes` (a lab's, recorded when it was made: found even after the name is deleted)."""
    found = [f"netns {n}" for n in netns_names() if n.startswith(prefix)]
    links = sh("ip", "-o", "link", "show", check=False).stdout
    found += [
        f"link {line.split(':')[1].strip()}"
        for line in links.splitlines()
        if line.split(":")[1].strip().startswith(prefix)
    ]
    if NETNS_ETC.is_dir():
        found += [f"{p}" for p in NETNS_ETC.iterdir() if p.name.startswith(prefix)]
    watched, others = set(inodes), set[int]()
    for name in netns_names():
        with contextlib.suppress(OSError):  # deleted meanwhile
            (watched if name.startswith(prefix) else others).add(netns_inode(name))
    # A freed namespace's inode number is given to the next one made: a live namespace of
    # another run's may carry one of ours.
    found += [f"process {pid}" for pid in processes_in(watched - others)]
    return found


def kill_bounded(proc: subprocess.Popen[str], timeout: float = WAIT_S) -> None:
    """SIGKILL and reap it; TimeoutExpired when it is not gone within `timeout`."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=timeout)


def _kill_pid(pid: int, timeout: float = WAIT_S) -> None:
    """SIGKILL a process that need not be our child and wait (bounded) until it is gone; a
    pidfd, so a reused pid is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError(f"process {pid} outlived SIGKILL by {timeout} s")
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def remove_namespace(name: str) -> None:
    """Every process in it killed by pid, then the namespace and its /etc/netns folder (those
    whatever the kills did; the first kill's error raised after)."""
    errors: list[OSError] = []
    try:
        for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                _kill_pid(int(pid))
            except OSError as exc:
                errors.append(exc)
    finally:
        sh("ip", "netns", "del", name, check=False)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    if errors:
        raise errors[0]


def _owner_alive(name: str) -> bool | None:
    """Whether the run that made `name` is alive; None when its name does not say."""
    if (found := OWNER.match(name)) is None:
        return None
    try:
        os.kill(int(found[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale() -> tuple[list[str], list[str]]:
    """Namespaces (and their processes and /etc/netns folders) of earlier runs whose owner
    is dead, removed; returns (removed, kept): kept are those of live runs and those whose
    names carry no owner, reported only."""
    removed, kept = [], []
    names = set(netns_names())
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    for name in sorted(n for n in names if n.startswith(PREFIX)):
        if _owner_alive(name) is False:
            remove_namespace(name)
            removed.append(name)
        else:
            kept.append(name)
    return removed, kept


@dataclass
class Host:
    name: str  # its short name in the lab (s0, balancer, client)
    netns: str
    ip: str
    procs: list[Process] = field(default_factory=list)

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh(*self.exec_argv(argv), check=check)


class Lab:
    """A switch, a DNS host and the hosts added to it; `close` removes all of it (call it in a
    finally: each step of the making is recorded first, so a half-made lab is removed too)."""

    def __init__(self, workdir: Path, run_id: str = "") -> None:
        self.run_id = run_id or run_prefix()[len(PREFIX) :]
        self.prefix = f"{PREFIX}{self.run_id}"
        self.workdir = workdir
        self.hosts: dict[str, Host] = {}
        self.namespaces: list[str] = []
        self.inodes: set[int] = set()  # each namespace's, for finding its processes later
        self.others: list[subprocess.Popen[str]] = []  # dnsmasq, delay readers
        self.records = workdir / "servers.hosts"
        self.dnsmasq: subprocess.Popen[str] | None = None
        self._next_ip = 10
        try:
            self.switch = self._namespace("sw")
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            self.dns = self.add("dns", DNS_IP)
        except BaseException:
            self.close()  # the caller never gets a lab to close
            raise

    def _namespace(self, short: str) -> str:
        name = f"{self.prefix}-{short}"
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        self.inodes.add(netns_inode(name))
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def add(self, short: str, ip: str = "") -> Host:
        """A host on the switch with its own address, resolving through the lab's dnsmasq."""
        if not ip:
            ip = f"{SUBNET}.{self._next_ip}"
            self._next_ip += 1
        netns = self._namespace(short)
        etc = NETNS_ETC / netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(f"nameserver {DNS_IP}\noptions timeout:1 attempts:2\n")
        # Both ends are made in the switch (the names are its own), one then moved to the host.
        port = f"p{len(self.hosts)}"
        sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "eth0")
        sh("ip", "-n", self.switch, "link", "set", "eth0", "netns", netns)
        sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", netns, "link", "set", "eth0", "up")
        host = Host(short, netns, ip)
        self.hosts[short] = host
        return host

    def start_dns(self, addresses: Sequence[str]) -> None:
        self.set_records(addresses, reload=False)
        argv = [
            "dnsmasq",
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.records}",
            "--local-ttl=0",  # every lookup sees the record set as it is now
            f"--listen-address={DNS_IP}",
            "--bind-interfaces",
            "--user=root",
            "--pid-file=",
            "--log-facility=-",
        ]
        self.dnsmasq = subprocess.Popen(
            self.dns.exec_argv(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.others.append(self.dnsmasq)

    def set_records(self, addresses: Sequence[str], *, reload: bool = True) -> None:
        """`servers.<domain>` answers `addresses` from now on: the file is replaced whole
        (written beside it, renamed over it), then dnsmasq is told to re-read it."""
        staged = self.records.with_suffix(".new")
        staged.write_text("".join(f"{ip} servers.{DOMAIN}\n" for ip in addresses))
        staged.replace(self.records)
        if reload and self.dnsmasq is not None:
            self.dnsmasq.send_signal(signal.SIGHUP)

    def start(self, host: Host, argv: Sequence[str], start_s: float = 60.0) -> Process:
        """A Sluice command run in `host`, up once it announces its address."""
        proc = Process(host.exec_argv(argv), start_s=start_s)
        host.procs.append(proc)
        return proc

    def server(self, host: Host, *extra: str) -> Process:
        argv = [str(BIN / "sluice-server"), "--device", "cpu", "--host", host.ip]
        argv += ["--port", str(PORT), "--node-id", host.name, *extra]
        return self.start(host, argv)

    def balancer(self, host: Host, *extra: str) -> Process:
        argv = [str(BIN / "sluice-balancer"), "--host", host.ip, "--port", str(PORT)]
        argv += ["--node-id", host.name, "--backends-dns", f"servers.{DOMAIN}:{PORT}"]
        return self.start(host, [*argv, *extra])

    def close(self) -> None:
        """Kill every process by its pid, then delete the namespaces (their links, addresses
        and rules with them; what still runs in them killed first) and the /etc/netns
        folders. Each step is tried whatever the others did; the first error is raised after."""
        errors: list[Exception] = []
        for host in self.hosts.values():
            for proc in host.procs:
                try:
                    kill_bounded(proc.proc)
                    proc.close()
                except Exception as exc:
                    errors.append(exc)
        for other in self.others:
            try:
                kill_bounded(other)
            except Exception as exc:
                errors.append(exc)
        for name in reversed(self.namespaces):
            try:
                remove_namespace(name)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
