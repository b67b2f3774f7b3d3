"""`sluice top` against two real servers behind a real balancer, and against nothing."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from sluice.client import SluiceClient
from tests.e2e.harness import BIN, Process, balancer_argv, running, server_argv, wait_health

pytestmark = pytest.mark.e2e

CALLS = 20


@dataclass
class Pair:
    servers: list[Process]
    balancer: Process


@pytest.fixture(scope="module")
def counted() -> Iterator[Pair]:
    with ExitStack() as stack:
        servers = [
            stack.enter_context(running(server_argv(node_id=f"top-server-{i}"))) for i in range(2)
        ]
        balancer = stack.enter_context(running(balancer_argv(*(s.address for s in servers))))
        rng = np.random.default_rng(10)
        with SluiceClient(balancer.address) as client:
            for _ in range(CALLS):
                client.predict({"input": rng.uniform(0, 16, (1, 64)).astype(np.float32)})
        wait_health(balancer.address, lambda h: h.requests >= CALLS, "the calls to be counted")
        yield Pair(servers, balancer)


def top(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "160"}
    return subprocess.run(
        [str(BIN / "sluice"), "top", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def test_once_on_a_balancer_names_it_and_every_backend(counted: Pair) -> None:
    done = top("--target", counted.balancer.address, "--once")
    assert done.returncode == 0, done.stderr
    header = first_line(done.stdout)
    assert "balancer" in header and "test-balancer" in header and "SERVING" in header
    for server in counted.servers:
        row = next(line for line in done.stdout.splitlines() if server.address in line)
        assert "SERVING" in row and "CLOSED" in row
    calls = next(line for line in done.stdout.splitlines() if line.startswith("calls "))
    assert int(calls.split()[1].replace(",", "")) >= CALLS
    assert "Traceback" not in done.stderr


def test_once_on_a_server_shows_its_batcher_and_cache(counted: Pair) -> None:
    server = counted.servers[0]
    done = top("--target", server.address, "--once")
    assert done.returncode == 0, done.stderr
    header = first_line(done.stdout)
    assert "server" in header and "top-server-0" in header and "CPUExecutionProvider" in header
    for section in ("Traffic", "Errors by status", "Batcher", "Cache", "queue depth", "hit rate"):
        assert section in done.stdout
    assert "Backends" not in done.stdout


def test_iterations_poll_again_and_show_a_rate(counted: Pair) -> None:
    done = top("--target", counted.balancer.address, "--interval", "0.2", "--iterations", "3")
    assert done.returncode == 0, done.stderr
    assert "test-balancer" in done.stdout
    rate = next(line for line in done.stdout.splitlines() if line.startswith("calls/s"))
    assert rate.split()[1] != "-"  # the last screen compares two polls
    assert "Traceback" not in done.stderr


@contextmanager
def live_top(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`sluice top ARGS` on a terminal (a pty): the process and the pty's controller side;
    killed if still running at the end, the pty closed."""
    controller, terminal = os.openpty()
    proc = subprocess.Popen(
        [str(BIN / "sluice"), "top", *args],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env={**os.environ, "COLUMNS": "160", "TERM": "xterm-256color"},
    )
    os.close(terminal)
    try:
        yield proc, controller
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(controller)


def exited_cleanly(proc: subprocess.Popen[bytes], seen: bytes) -> None:
    assert proc.returncode == 0
    assert b"Traceback" not in seen
    assert b"KeyboardInterrupt" not in seen


def read_until_exit(proc: subprocess.Popen[bytes], controller: int, within: float) -> bytes:
    """What the terminal shows until the process exits (bounded by `within` seconds). Reading
    while it exits matters: a full pty buffer would block its last redraw."""
    seen = b""
    deadline = time.monotonic() + within
    while True:
        ready = select.select([controller], [], [], 0.2)[0]
        chunk = b""
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed with the process
                chunk = b""
        seen += chunk
        if proc.poll() is not None and not chunk:
            return seen
        assert time.monotonic() < deadline, "sluice top did not exit on SIGINT"


def test_ctrl_c_leaves_the_live_view_with_exit_0(counted: Pair) -> None:
    """On a terminal (a pty) the live view draws; SIGINT, as Ctrl-C sends, ends it cleanly."""
    with live_top("--target", counted.balancer.address, "--interval", "0.2") as (proc, controller):
        seen = b""
        deadline = time.monotonic() + 60
        while seen.count(b"test-balancer") < 2:  # drawn, then redrawn: the loop is running
            assert time.monotonic() < deadline, f"no live view: {seen.decode(errors='replace')}"
            if select.select([controller], [], [], 0.5)[0]:
                seen += os.read(controller, 65536)
        proc.send_signal(signal.SIGINT)
        seen += read_until_exit(proc, controller, 30)
    exited_cleanly(proc, seen)


@pytest.fixture
def mute() -> Iterator[tuple[str, threading.Event]]:
    """A gRPC server whose Health never answers (until the test ends): its address, and an
    event set when a call has arrived."""
    arrived, release = threading.Event(), threading.Event()

    def health(request: bytes, context: grpc.ServicerContext) -> bytes:
        arrived.set()
        release.wait(60)
        return b""

    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    handler = grpc.unary_unary_rpc_method_handler(health)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("sluice.v1.Inference", {"Health": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", arrived
    finally:
        release.set()
        server.stop(None)


def test_ctrl_c_during_a_poll_without_answer_exits_0(mute: tuple[str, threading.Event]) -> None:
    """SIGINT while the Health call is under way is taken when the call ends (at its --timeout):
    it is never raised inside grpc's call, and the view still exits 0, without a traceback."""
    target, arrived = mute
    args = ("--target", target, "--interval", "0.2", "--timeout", "2")
    with live_top(*args) as (proc, controller):
        assert arrived.wait(60), "sluice top never called Health"
        time.sleep(0.3)  # past grpc's first check for signals in the call (every 0.2 s)
        proc.send_signal(signal.SIGINT)
        seen = read_until_exit(proc, controller, 30)
    exited_cleanly(proc, seen)


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_target_is_one_line_and_exit_1() -> None:
    target = f"127.0.0.1:{closed_port()}"
    done = top("--target", target, "--once", "--timeout", "2")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"sluice top: {target} unreachable: UNAVAILABLE")


def test_live_view_keeps_trying_an_unreachable_target() -> None:
    target = f"127.0.0.1:{closed_port()}"
    done = top("--target", target, "--interval", "0.1", "--timeout", "0.5", "--iterations", "3")
    assert done.returncode == 1  # the last poll got no answer
    assert f"{target}  unreachable: UNAVAILABLE" in done.stdout
    assert "still trying" in done.stdout
    assert done.stderr == ""
