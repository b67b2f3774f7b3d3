"""The images tier's Docker engine and what it makes there. The engine is the one that answers
(DOCKER_HOST or the default socket), or else a dockerd of the tier's own: its socket, data
and state in a scratch folder, no bridge of its own, no iptables rules, no forwarding and no
masquerade (the containers share one bridge and the host reaches them directly), so it
leaves no docker0, nft tables or net.ipv4.ip_forward change behind; started in a process
group of its own, which is stopped (its containerd with it), and its folder removed. Builds
run on the host's network (--network host), so they need no NAT. Everything made carries the
session's prefix, which `leftovers` looks for."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.harness import wait_for

REPO = Path(__file__).resolve().parents[2]
PREFIX = "sluice-images-"
BASE = "sluice-base:bookworm"  # the Dockerfile's default BASE, which scripts/make-base makes
# Extra certificate authorities the machine trusts (update-ca-certificates' own folder):
# pip inside the build trusts them too, as the Dockerfile's PIP_CA.
LOCAL_CAS = Path("/usr/local/share/ca-certificates")


def why_not() -> str:
    """Why no image can be built and run here; "" if one can."""
    if sys.platform != "linux":
        return "the images tier runs on Linux"
    if os.geteuid() != 0:
        return "the images tier runs as root (dockerd, debootstrap)"
    if shutil.which("docker") is None:
        return "no docker client (apt-get install docker.io)"
    return ""


@dataclass
class Engine:
    env: dict[str, str]
    made: list[str] = field(default_factory=list)  # image ids and tags, removed in `close`

    def docker(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None) -> str:
        return checked(["docker", *args], {**self.env, **(env or {})}, timeout)

    def answers(self) -> bool:
        try:
            self.docker("version", "--format", "{{.Server.Version}}", timeout=20)
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return True

    def has_image(self, name: str) -> bool:
        try:
            self.docker("image", "inspect", name)
        except RuntimeError:
            return False
        return True

    def build(self, tag: str) -> None:
        """The repository's Dockerfile as `tag`, on the base scripts/make-base makes (made
        here if the engine lacks it, and then removed with the rest)."""
        if not self.has_image(BASE):
            checked([str(REPO / "scripts" / "make-base"), BASE], self.env, 900)
            self.made.append(BASE)
        cas = "".join(p.read_text() for p in sorted(LOCAL_CAS.rglob("*.crt")))
        args = ["build", "--network", "host", "--build-arg", f"BASE={BASE}", "-t", tag]
        args += ["--build-arg", f"PIP_CA={cas}", str(REPO)]
        # The legacy builder (asked for: BuildKit logs otherwise) keeps the first stage as an
        # untagged image: its id is the last one the build printed before the final FROM.
        out = self.docker(*args, timeout=900, env={"DOCKER_BUILDKIT": "0"})
        stages = re.split(r"^Step \d+/\d+ : FROM ", out, flags=re.MULTILINE)[1:]
        built = [re.findall(r"^ ---> ([0-9a-f]{12,})$", s, re.MULTILINE) for s in stages]
        self.made[:0] = [tag] + [ids[-1] for ids in built[:-1] if ids]

    def remove(self, *args: str) -> None:
        with suppress(RuntimeError):
            self.docker(*args)

    def close(self, run: str) -> None:
        """Remove every container and network of `run`, then the images made."""
        containers = self.docker("ps", "-a", "-q", "--filter", f"name={run}").split()
        if containers:
            self.remove("rm", "-f", *containers)
        networks = self.docker("network", "ls", "-q", "--filter", f"name={run}").split()
        if networks:
            self.remove("network", "rm", *networks)
        for image in self.made:
            self.remove("rmi", image)

    def leftovers(self, run: str) -> list[str]:
        found = self.docker("ps", "-a", "--format", "{{.Names}}", "--filter", f"name={run}")
        found += self.docker("network", "ls", "--format", "{{.Name}}", "--filter", f"name={run}")
        return found.split() + [i for i in self.made if self.has_image(i)]


@contextmanager
def docker_engine() -> Iterator[Engine]:
    """The engine that answers, or one of our own, stopped and removed afterwards."""
    running = Engine(dict(os.environ))
    if running.answers():
        yield running
        return
    if shutil.which("dockerd") is None:
        raise LookupError("no Docker engine answers and no dockerd (apt-get install docker.io)")
    scratch = Path(tempfile.mkdtemp(prefix=PREFIX))  # short: sockets live under it
    env = {**os.environ, "DOCKER_HOST": f"unix://{scratch}/docker.sock"}
    argv = ["dockerd", "--host", env["DOCKER_HOST"], "--data-root", f"{scratch}/data"]
    argv += ["--exec-root", f"{scratch}/exec", "--pidfile", f"{scratch}/dockerd.pid"]
    argv += ["--bridge=none", "--iptables=false", "--ip6tables=false"]
    argv += ["--ip-forward=false", "--ip-masq=false"]
    with (scratch / "dockerd.log").open("wb") as log:
        # Its own group, so that what it starts (containerd) is stopped with it.
        daemon = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        ours = Engine(env)
        wait_for(lambda: daemon.poll() is not None or ours.answers(), "dockerd", 60)
        if daemon.poll() is not None:
            raise LookupError(f"dockerd exited: {(scratch / 'dockerd.log').read_text()[-2000:]}")
        yield ours
    finally:
        stop_group(daemon, 60)
        # dockerd leaves its namespace file (exec-root/netns/default) mounted when it stops.
        for mount in reversed(mounts_under(scratch)):
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
        left = [str(scratch)] if scratch.exists() else []
        assert not left + mounts_under(scratch), f"dockerd left {left + mounts_under(scratch)}"


def mounts_under(folder: Path) -> list[str]:
    """The mount points inside `folder`, outermost first (Linux: /proc/self/mounts)."""
    points = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return sorted(p for p in points if p.startswith(f"{folder}/"))


def checked(argv: list[str], env: dict[str, str], timeout: float) -> str:
    """`argv`'s output; RuntimeError with the tail of what it said if it fails."""
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        name = " ".join([Path(argv[0]).name, *argv[1:3]])
        raise RuntimeError(f"{name} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the process group `proc` leads; SIGKILL to what is left of it once `proc`
    has exited or `grace` seconds have passed."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def ip_forward() -> str:
    """The host's net.ipv4.ip_forward, which the tier must leave as it found it."""
    return IP_FORWARD.read_text().strip()
