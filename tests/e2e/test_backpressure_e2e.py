"""Backpressure on PredictStream: a caller that writes and never reads stalls once a bounded
number of messages is in buffers (the stream stops reading, HTTP/2 flow control pushes
back), the node's memory stays bounded meanwhile, and when the caller reads again every call
is answered. Through a server and through a balancer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.e2e.harness import BIN, Process, running, running_server

pytestmark = pytest.mark.e2e

STREAM = "/sluice.v1.Inference/PredictStream"
ROWS = 32  # rows per call: 8 KiB bodies, so buffers fill after few messages
TOTAL = 6_000  # messages the caller would write: about 50 MB, far more than the bound
# Without BDP probing the caller's own receive window stays at 64 KiB, so replies it does not
# read stop within it; with probing its transport buffers megabytes of them first (the
# caller's memory, not the node's) and the stall comes later.
OPTIONS = [("grpc.http2.bdp_probe", 0)]
STALLED_S = 2.0  # no write completes for this long: the sender is held back
MIB = 1 << 20


def rss(pid: int) -> int:
    """Resident memory of `pid` in bytes (Linux: VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def message(i: int, body: bytes) -> bytes:
    return pb.StreamRequest(id=i, request=body, timeout_s=60).SerializeToString()


async def flood(address: str, pid: int) -> tuple[int, int]:
    """Write TOTAL messages without reading until the writes stall; then read every answer.
    Returns how many messages were written before the stall and the node's RSS growth."""
    x = np.random.default_rng(5).uniform(0, 16, (ROWS, 64)).astype(np.float32)
    body = pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString()
    sent = 0
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        call = channel.stream_stream(STREAM)()  # written and read by hand

        async def write() -> None:
            nonlocal sent
            for i in range(1, TOTAL + 1):
                await call.write(message(i, body))
                sent += 1
            await call.done_writing()

        before = rss(pid)
        writing = asyncio.create_task(write())
        try:
            # Until no write completes for STALLED_S (bounded: a guard against a hang).
            deadline = time.monotonic() + 120
            last, since = -1, time.monotonic()
            while time.monotonic() - since < STALLED_S:
                assert time.monotonic() < deadline, f"writes never stalled ({sent} sent)"
                if writing.done():
                    writing.result()  # a failed write raises here
                    raise AssertionError(f"all {TOTAL} messages were taken without a read")
                if sent != last:
                    last, since = sent, time.monotonic()
                await asyncio.sleep(0.05)
            stalled_at = sent
            growth = rss(pid) - before

            answered: set[int] = set()
            async for raw in call:  # read again: the writer resumes, every call is answered
                reply = pb.StreamResponse.FromString(raw)
                assert reply.code == 0, reply.message
                answered.add(reply.id)
            await asyncio.wait_for(writing, 60)
        finally:
            writing.cancel()
        assert answered == set(range(1, TOTAL + 1))
        return stalled_at, growth


def check(stalled_at: int, growth: int) -> None:
    # Bounded: the bound, socket and HTTP/2 buffers hold a small share of what was to be sent.
    assert stalled_at < TOTAL * 3 // 5, f"{stalled_at} messages were taken before the stall"
    assert growth < 40 * MIB, f"RSS grew {growth / MIB:.1f} MiB while the caller did not read"


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with running_server(node_id="backpressure") as proc:
        yield proc


def test_a_caller_that_never_reads_is_held_back_by_the_server(server: Process) -> None:
    check(*asyncio.run(flood(server.address, server.pid)))


def test_a_caller_that_never_reads_is_held_back_by_the_balancer(server: Process) -> None:
    argv = [str(BIN / "sluice-balancer"), "--port", "0", "--node-id", "backpressure-balancer"]
    with running([*argv, "--backend", server.address]) as balancer:
        check(*asyncio.run(flood(balancer.address, balancer.pid)))
