"""perf.delayq's start is bounded: a queue that never answers, a reader that never says it is
bound, end in an error, not a hung test. They need no namespace."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from perf import delayq
from perf.netfaults import first_line


def test_delayq_bind_gives_up_when_not_answered() -> None:
    mine, silent = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with mine, silent, pytest.raises(TimeoutError):
        delayq.bind(mine, 7, timeout_s=0.05)


def test_first_line_gives_up_when_nothing_is_written() -> None:
    quiet = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first_line(quiet, 0.05) == ""
    finally:
        quiet.kill()
        quiet.communicate(timeout=30)
