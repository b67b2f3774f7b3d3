"""The balancer's hang detection against a toy grpc.aio server: one whose event loop is
blocked (busy, alive) keeps its connection, because grpc's own threads answer the HTTP/2
pings; a stopped one (SIGSTOP) loses it within about 1.3 x keepalive_s."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from sluice.balancer.upstream import Upstream

pytestmark = pytest.mark.e2e

BLOCK_S = 3.0  # the old rule (two health checks missed in a row) took it out in 1-1.5 s

TOY_SERVER = f"""
import asyncio, time, grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

async def main():
    server = grpc.aio.server(options=[
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 100),
        ("grpc.http2.max_ping_strikes", 0),
    ])
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)

    async def block(request, context):
        started = time.monotonic()
        while time.monotonic() - started < {BLOCK_S}:  # holds the loop and the GIL
            sum(range(1000))
        return b""

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "toy.Toy", {{"Block": grpc.unary_unary_rpc_method_handler(block)}})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


@pytest.fixture
def toy() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The toy server (stopped by its pid at the end) and its address."""
    proc = subprocess.Popen([sys.executable, "-c", TOY_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, f"127.0.0.1:{proc.stdout.readline().strip()}"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()  # or the pipe is left to the garbage collector


async def test_a_busy_server_is_not_taken_for_hung_but_a_stopped_one_is(
    toy: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = toy
    upstream = Upstream(address, keepalive_s=1.0)
    reports: list[tuple[float, str, bool]] = []
    heard, out = asyncio.Event(), asyncio.Event()

    def report(state: str, lost: bool, why: str) -> None:
        reports.append((time.monotonic(), state, lost))
        heard.set()
        if state == "NOT_SERVING":
            out.set()

    try:
        upstream.watch_health(report)
        await asyncio.wait_for(heard.wait(), 10.0)
        # Busy: the loop is blocked for 3 x keepalive_s; the call is answered late, the
        # connection lives and nothing says NOT_SERVING.
        reply = await upstream.unary("/toy.Toy/Block", b"", {}, 30.0)
        assert reply.code == 0
        await asyncio.sleep(1.0)
        assert [state for _, state, _ in reports] == ["SERVING"], reports
        assert not upstream.hung
        # Stopped: the pings go unanswered and its connection is closed.
        proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        await asyncio.wait_for(out.wait(), 10.0)
        found = next(t for t, state, _ in reports if state == "NOT_SERVING") - stopped
        assert found < 6.0  # about 1.3 s; loose for a loaded machine
        print(f"stopped server found after {found:.2f} s")
    finally:
        proc.send_signal(signal.SIGCONT)
        await upstream.close()
