"""Load at the edges: a burst of concurrent calls is served or refused with a reason, never
dropped with a bare CANCELLED; and a 25 MB request leaves no lasting memory behind."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice.client import SluiceClient
from sluice.server.dataplane.buffers import BufferPool
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.e2e.harness import running_server

pytestmark = pytest.mark.e2e

PREDICT = "/sluice.v1.Inference/Predict"
MIB = 1 << 20
BURST = 2_000  # grpc core's defaults dropped calls past 1,000 waiting for the application
BIG_ROWS = 100_000  # FP32 [100000, 64]: a 25.6 MB request (and a 4.8 MB reply)
BIG_OPTIONS = [
    ("grpc.max_send_message_length", 64 * MIB),
    ("grpc.max_receive_message_length", 64 * MIB),
]


def body(x: np.ndarray) -> bytes:
    return pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString()


def health(address: str) -> pb.HealthResponse:
    # Its own connection: not queued behind the calls under test.
    with SluiceClient(address, options=[("grpc.use_local_subchannel_pool", 1)]) as client:
        return client.health(timeout=10)


async def burst(address: str, bodies: list[bytes]) -> list[tuple[grpc.StatusCode, str]]:
    """Every body sent at once on one channel; each call's status and message."""
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)

        async def one(request: bytes) -> tuple[grpc.StatusCode, str]:
            try:
                await predict(request, timeout=25)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""
            return grpc.StatusCode.OK, ""

        return await asyncio.gather(*(one(b) for b in bodies))


def test_a_burst_is_served_or_refused_with_a_reason() -> None:
    # Distinct inputs: each call runs the model (no cache hits), so the burst outruns the
    # server and some calls wait in grpc core before the application takes them.
    rows = np.random.default_rng(7).uniform(0, 16, (BURST, 1, 64)).astype(np.float32)
    bodies = [body(x) for x in rows]
    with running_server(node_id="burst") as server:
        server.wait_serving()
        before = health(server.address)
        outcomes = asyncio.run(burst(server.address, bodies))
        after = health(server.address)
    codes = Counter(code for code, _ in outcomes)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    refusals = [message for code, message in outcomes if code != grpc.StatusCode.OK]
    assert all(refusals), "a refusal came without a message"
    # Every call reached the application and is counted in Health, refusals among errors.
    assert after.requests - before.requests == BURST
    exhausted = "RESOURCE_EXHAUSTED"
    refused = after.errors_by_code[exhausted] - before.errors_by_code[exhausted]
    assert refused == len(refusals)


def rss(pid: int) -> int:
    """Resident memory of `pid` in bytes (Linux: VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_large_request_leaves_no_lasting_memory() -> None:
    """Three 25 MB batches, each followed by a small call (grpc keeps the state of the last
    call it took until it takes the next). The result cache is off: what it keeps is bounded
    by --cache-bytes, not a leak."""
    small = body(np.zeros((1, 64), np.float32))
    rng = np.random.default_rng(11)
    grown: list[float] = []
    with running_server("--cache-entries", "0", node_id="big") as server:
        server.wait_serving()
        with grpc.insecure_channel(server.address, options=BIG_OPTIONS) as channel:
            predict = channel.unary_unary(
                PREDICT, request_serializer=None, response_deserializer=None
            )
            predict(small, timeout=10)
            before = rss(server.pid)
            for _ in range(3):
                big = body(rng.uniform(0, 16, (BIG_ROWS, 64)).astype(np.float32))
                predict(big, timeout=25)
                del big
                predict(small, timeout=10)
                time.sleep(0.5)  # settle
                grown.append((rss(server.pid) - before) / MIB)
    report = ", ".join(f"{g:.0f}" for g in grown)
    # Measured: +10-21 MiB after the first call, +33-34 MiB after the third (heap the
    # runtime reuses: glibc keeps up to 16 MiB free in each of 2 arenas); with glibc's 16
    # arenas instead, up to +47 and +58; without the fixes +290 MiB and more after every call.
    assert grown[0] < 48, f"RSS grew {report} MiB after each 25 MB call"
    assert grown[-1] < 64, f"RSS grew {report} MiB after each 25 MB call"


def test_the_staging_pool_keeps_no_buffer_of_a_rare_large_batch() -> None:
    """On CUDA every request is staged: a 25 MB one takes a 32 MiB buffer (rows rounded up to
    a power of two), which a 256 MiB pool would otherwise keep for good."""
    pool = BufferPool(max_bytes=256 * MIB)
    fp32 = np.dtype("float32")
    large = pool.take(fp32, (64,), BIG_ROWS)
    assert large.nbytes == 32 * MIB
    pool.give(large)
    assert pool.stats().buffers == 0 and pool.stats().dropped == 1
    small = pool.take(fp32, (64,), 64)  # the sizes batches take again and again are kept
    pool.give(small)
    assert pool.stats().buffers == 1 and pool.stats().bytes == small.nbytes
