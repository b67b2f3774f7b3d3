"""The lab's own cleanup and leak checks (perf.hosts): what the other tests of the tier rely
on to leave nothing behind."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import cast

import pytest

from perf.hosts import NETNS_ETC, PREFIX, Host, Lab, leftovers, netns_names, remove_stale, sh


class Stuck:
    """A process that outlives the wait for it."""

    pid = 0

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired("stuck", timeout or 0.0)


@contextmanager
def stray(host: Host) -> Iterator[int]:
    """A process in `host` that no Lab list knows of (a daemon's child); a pidfd of it,
    killed at the end whatever the test did."""
    line = "sleep 600 >/dev/null 2>&1 & echo $!"
    pid = int(host.run("sh", "-c", line).stdout)
    fd = os.pidfd_open(pid)
    try:
        yield fd
    finally:
        with suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], 10.0)
        os.close(fd)


def gone(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@pytest.mark.hosts
def test_close_removes_the_namespaces_when_a_process_will_not_go(lab: Lab) -> None:
    host = lab.add("h")
    stuck = cast(subprocess.Popen[str], Stuck())
    lab.others.append(stuck)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            lab.close()
    finally:
        lab.others.remove(stuck)
    assert [n for n in netns_names() if n.startswith(lab.prefix)] == []
    assert not (NETNS_ETC / host.netns).exists()


@pytest.mark.hosts
def test_close_kills_what_runs_in_a_namespace(lab: Lab) -> None:
    with stray(lab.add("h")) as fd:
        lab.close()
        assert gone(fd)


@pytest.mark.hosts
def test_leftovers_finds_a_process_in_a_deleted_namespace(lab: Lab) -> None:
    host = lab.add("h")
    with stray(host) as fd:
        sh("ip", "netns", "del", host.netns)
        pids = [line for line in leftovers(lab.prefix, lab.inodes) if line.startswith("process")]
        assert len(pids) == 1
        assert not gone(fd)


@pytest.mark.hosts
def test_remove_stale_removes_a_dead_runs_namespace_only(lab: Lab) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = f"{PREFIX}{int(done.stdout)}x{lab.run_id[-4:]}-sw"
    live = f"{lab.prefix}-live"
    for name in (dead, live):
        sh("ip", "netns", "add", name)
    lab.namespaces.append(live)
    (NETNS_ETC / dead).mkdir(parents=True, exist_ok=True)
    try:
        removed, kept = remove_stale()
        assert dead in removed
        assert live in kept
        assert dead not in netns_names() and not (NETNS_ETC / dead).exists()
        assert live in netns_names()
    finally:
        sh("ip", "netns", "del", dead, check=False)
        shutil.rmtree(NETNS_ETC / dead, ignore_errors=True)


def test_the_tier_ends_clean_where_hosts_cannot_be_made(tmp_path: Path) -> None:
    """No `ip` on the PATH: the tests that need no lab pass, and the session's leak check
    does not run `ip` (it would end the session in FileNotFoundError)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/hosts/test_netfaults.py",
        ],
        env={**os.environ, "PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
