"""The engine's helpers on plain processes: a failed command says what it printed, and a
stopped group leaves none of its members, even one that ignores SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import wait_for
from tests.images.engine import checked, stop_group

pytestmark = pytest.mark.images

# Ignores SIGTERM, says its pid, and waits (bounded) to be killed.
STUBBORN = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print(os.getpid(), flush=True); time.sleep(120)"
)


def test_a_failed_command_raises_with_the_tail_of_its_stderr() -> None:
    argv = [sys.executable, "-c", "import sys; sys.exit('x' * 5000 + ' no bookworm source')"]
    with pytest.raises(RuntimeError, match=r"exited 1: x+ no bookworm source$") as raised:
        checked(argv, dict(os.environ), 30)
    assert len(str(raised.value)) < 2100


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for init to reap it counts)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_stopping_a_group_kills_what_its_leader_left_behind() -> None:
    # The leader exits on SIGTERM; its child ignores it, as an orphaned shim would outlive it.
    leader_code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); time.sleep(120)"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", leader_code], stdout=subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    try:
        stop_group(leader, 10)
        wait_for(lambda: gone(child), "the leader's child to exit", 10)
    finally:
        if not gone(child):
            os.kill(child, 9)
        leader.stdout.close()
