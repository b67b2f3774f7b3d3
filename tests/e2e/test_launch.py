"""The launcher every e2e test and benchmark starts processes with: the address a process
announces is found whatever way its lines arrive, and a process that dies says why."""

from __future__ import annotations

import sys

import pytest

from perf.launch import Process

pytestmark = pytest.mark.e2e


def script(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_address_announced_in_the_same_write_as_the_line_before() -> None:
    # Both lines in one write: the announcement must not wait in a buffer.
    proc = Process(
        script(
            "import sys, time\n"
            "sys.stderr.write('starting\\nlistening on 127.0.0.1:4321\\n'); sys.stderr.flush()\n"
            "time.sleep(60)"
        )
    )
    try:
        assert proc.address == "127.0.0.1:4321"
        assert proc.lines[:2] == ["starting\n", "listening on 127.0.0.1:4321\n"]
    finally:
        proc.kill()


def test_a_process_that_exits_before_listening_fails_with_its_log() -> None:
    with pytest.raises(RuntimeError, match=r"did not start \(exit status 3\):\nno model here"):
        Process(script("import sys; sys.stderr.write('no model here\\n'); sys.exit(3)"))
