"""`sluice up` when a server cannot start, or when Ctrl-C comes while it waits for one: it
stops every process it started and exits at once, with one line saying which and why. A port
that is taken is found before anything starts: by `sluice up` for every port it will use, and
by a server or balancer for its own before it loads models or asks for backends."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import BIN, alive, wait_for

pytestmark = pytest.mark.e2e

# A bound, not a measure: the issue asks for a second or two, and what it costs here is a
# Python start or two with grpc imported (a few seconds on a loaded 2-core machine). Well
# under the 60 s `sluice up` waits for a server to start, and under what loading a model and
# starting the rest would take, so a check that came after those fails here.
RETURNS_S = 10.0
MARK = "SLUICE_UP_TEST_MARK"


def started_by(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (every child of `sluice up` inherits
    it): found whether or not they are still its children."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            pid = int(environ.parent.name)
            if needle in environ.read_bytes().split(b"\0") and alive(pid):
                found.append(pid)
    return sorted(found)


@contextlib.contextmanager
def sluice_up(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`sluice up ARGS` with its output (stdout and stderr) in one pipe, and the mark its
    processes carry; whatever it leaves running is killed by pid at the end."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [str(BIN / "sluice"), "up", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, MARK: mark},
    )
    try:
        yield proc, mark
    finally:
        for pid in started_by(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """Its exit status and output, once it exits on its own (bounded)."""
    try:
        output, _ = proc.communicate(timeout=RETURNS_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"sluice up still running after {RETURNS_S:g} s")
    return proc.returncode, output


def own_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("sluice up:")]


def test_a_server_whose_port_is_taken_stops_everything_at_once() -> None:
    # Servers take the ports after the balancer's: server-1 gets the taken one. It is
    # found before any process starts.
    with ports_in_a_row(3, held=1) as first:
        port = first + 1
        with sluice_up("--servers", "2", "--port", str(first)) as (proc, mark):
            code, output = finish(proc)
            assert code != 0, output
            [line] = own_lines(output)
            assert "server-1" in line and f"127.0.0.1:{port}" in line, output
            assert "cannot listen" in line, output
            assert "_InactiveRpcError" not in output, output
            assert started_by(mark) == [], output


def test_a_balancer_whose_port_is_taken_starts_no_server(tmp_path: Path) -> None:
    # A server that started would open its tenants file, a FIFO: the test's writer waiting on
    # it would see that open (the FIFO records every reader), however soon the server went.
    fifo = tmp_path / "tenants.toml"
    os.mkfifo(fifo)
    args = ("--servers", "2", "--server-arg", f"--tenants {fifo}")
    with (
        ports_in_a_row(3, held=0) as port,
        opened_by_a_reader(fifo) as opened,
        sluice_up(*args, "--port", str(port)) as (proc, mark),
    ):
        code, output = finish(proc)
        assert code != 0, output
        [line] = own_lines(output)
        assert "balancer" in line and f"127.0.0.1:{port}" in line, output
        assert "cannot listen" in line, output
        assert not opened.is_set(), "a server started"
        assert started_by(mark) == [], output


def test_a_balancer_that_cannot_start_stops_the_servers_at_once(tmp_path: Path) -> None:
    # The balancer logs JSON: its error is found in either log format.
    balancer = ("--balancer-arg", f"--log-format json --tenants {tmp_path / 'missing.toml'}")
    with sluice_up("--servers", "1", "--port", "0", *balancer) as (proc, mark):
        code, output = finish(proc)
        assert code != 0, output
        [line] = own_lines(output)
        assert "balancer" in line and "missing.toml" in line, output
        assert "_InactiveRpcError" not in output, output
        assert started_by(mark) == [], output


@pytest.mark.parametrize(
    "program",
    [
        # A model that does not exist, a tenants file that does not: a process that loaded
        # them before it looked at its port would say so instead of the port.
        ["sluice-server", "--device", "cpu", "--model", "missing.onnx"],
        ["sluice-balancer", "--backend", "127.0.0.1:1", "--tenants", "missing.toml"],
    ],
    ids=["server", "balancer"],
)
def test_a_program_whose_port_is_taken_says_so_before_it_loads(
    program: list[str], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = [str(BIN / program[0]), *program[1:], "--port", str(port)]
        done = subprocess.run(
            argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
        )
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "missing" not in done.stderr, done.stderr


@contextlib.contextmanager
def opened_by_a_reader(fifo: Path) -> Iterator[threading.Event]:
    """Set once any process opens `fifo` to read (a writer's open waits for one). At the end
    the test opens it itself, so the waiting writer is released."""
    opened = threading.Event()

    def wait_for_reader() -> None:
        os.close(os.open(fifo, os.O_WRONLY))  # returns once a reader has opened it
        opened.set()

    writer = threading.Thread(target=wait_for_reader, daemon=True)
    writer.start()
    try:
        yield opened
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer.join(timeout=RETURNS_S)
        os.close(reader)


@contextlib.contextmanager
def ports_in_a_row(count: int, held: int | None = None) -> Iterator[int]:
    """The first of `count` ports in a row (`sluice up`'s: the balancer's, then each
    server's), each free when looked at (bound and let go) but the `held`-th, which this
    test listens on until the end."""
    at = held or 0  # the row's port found by binding port 0
    for _ in range(50):
        with socket.socket() as found:
            found.bind(("127.0.0.1", 0))
            found.listen(1)
            first = int(found.getsockname()[1]) - at
            if not all(free(first + i) for i in range(count) if i != at):
                continue
            if held is None:
                found.close()  # free as well: let go like the others
            yield first
            return
    pytest.fail(f"no {count} ports in a row free in 50 tries")


def free(port: int) -> bool:
    """Whether nothing holds `port` (when looked at)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ctrl_c_while_a_server_starts_stops_everything_at_once(tmp_path: Path) -> None:
    # A server reads its tenants file before it listens: from a FIFO, that read waits for
    # the test, so the server stays alive and not serving for as long as the test likes.
    fifo = tmp_path / "tenants.toml"
    os.mkfifo(fifo)
    writer = -1
    with ports_in_a_row(2) as port:  # the balancer's and server-1's
        args = ("--servers", "1", "--port", str(port), "--server-arg", f"--tenants {fifo}")
    with sluice_up(*args) as (proc, mark):
        try:
            writer = wait_for(lambda: open_writer(fifo), "the server to open its tenants file")
            proc.send_signal(signal.SIGINT)
            code, output = finish(proc)
            assert code != 0, output
            [line] = own_lines(output)
            assert "server-1" in line and f"127.0.0.1:{port + 1}" in line, output
            assert "_InactiveRpcError" not in output, output
            assert started_by(mark) == [], output
        finally:
            if writer >= 0:
                os.close(writer)


def open_writer(fifo: Path) -> int | None:
    """The FIFO's write end once a reader has it open (None before)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
            raise
        return None
