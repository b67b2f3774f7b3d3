"""Hosts on one machine: network namespaces joined by veth pairs to a bridge, with private
addresses that exist only inside them, a dnsmasq answering `servers.<domain>` from a record
file it re-reads on SIGHUP, and the real Sluice commands started in them (`ip netns exec`).

The bridge lives in a namespace of its own (the switch), so the machine's own interfaces,
routes and firewall are never touched: deleting the namespaces removes every link, address
and iptables rule made here. Names carry a per-run prefix (`PREFIX` + a run id) so runs never
clash, and `leftovers` finds anything a run left behind."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from perf.launch import BIN, Process

PREFIX = "slh"  # every namespace, link and /etc/netns folder a lab makes starts with it
SUBNET = "10.213.0"  # a /24 that exists only inside the lab's namespaces
DNS_IP = f"{SUBNET}.2"
DOMAIN = "sluice.test"
PORT = 7000  # every server listens on it (one name, one port, as in a headless Service)
NETNS_ETC = Path("/etc/netns")  # `ip netns exec` bind-mounts NAME/resolv.conf from here


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


def leftovers(prefix: str = PREFIX) -> list[str]:
    """What labs with `prefix` left on this machine: namespaces, links in the machine's own
    namespace, /etc/netns folders, processes running in a lab namespace."""
    found = [f"netns {n}" for n in netns_names() if n.startswith(prefix)]
    links = sh("ip", "-o", "link", "show", check=False).stdout
    found += [
        f"link {line.split(':')[1].strip()}"
        for line in links.splitlines()
        if line.split(":")[1].strip().startswith(prefix)
    ]
    if NETNS_ETC.is_dir():
        found += [f"{p}" for p in NETNS_ETC.iterdir() if p.name.startswith(prefix)]
    return found


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
        self.run_id = run_id or secrets.token_hex(2)
        self.prefix = f"{PREFIX}{self.run_id}"
        self.workdir = workdir
        self.hosts: dict[str, Host] = {}
        self.namespaces: list[str] = []
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

    def pids(self) -> list[int]:
        """Every live process started in the lab."""
        mine = [p.proc for h in self.hosts.values() for p in h.procs] + self.others
        return [p.pid for p in mine if p.poll() is None]

    def close(self) -> None:
        """Kill every process by its pid, then delete the namespaces (their links, addresses
        and rules with them) and the /etc/netns folders."""
        for host in self.hosts.values():
            for proc in host.procs:
                proc.kill()
        for other in self.others:
            if other.poll() is None:
                other.kill()
            other.wait(timeout=30)
        for name in reversed(self.namespaces):
            sh("ip", "netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
