"""A server's resident memory stays flat under 602 KB calls at 32 in flight: the freed heap
the allocator keeps for the next call (sluice.runtime.process.return_large_blocks) is
bounded, and nothing a call leaves grows with the calls. Real server, the averaging model
(an image in, each channel's mean out), cache off, so every call runs.

The same load for a duration, as a benchmark (RSS at its start, middle and end):

    python -m tests.e2e.test_rss_flat_e2e --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest

from perf import make_pool
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.e2e.harness import running, server_argv

pytestmark = pytest.mark.e2e

PREDICT = "/sluice.v1.Inference/Predict"
MIB = 1 << 20
IN_FLIGHT = 32
CALLS = 3_000  # ~10 s here on 2 cores, warm-up included
WARMUP = 2 * IN_FLIGHT  # calls before the first sample: the model's first runs, the arenas
SAMPLE_EVERY = 50  # calls between RSS samples
# Growth allowed from the second third of the run to the last: what glibc keeps is at most
# ~2 arenas x 16 MiB, filled by then; a call that left 602 KB behind would add ~600 MiB.
GROWTH_MIB = 24


def rss(pid: int) -> int:
    """Resident memory of `pid` in bytes (Linux: VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def image_body() -> bytes:
    """A 1x3x224x224 FP32 image: a 602 KB request."""
    x = np.random.default_rng(5).uniform(0, 1, (1, 3, 224, 224)).astype(np.float32)
    return pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString()


async def load(
    address: str, pid: int, calls: int, seconds: float | None = None
) -> tuple[int, list[int]]:
    """`calls` 602 KB calls (or, with `seconds`, as many as fit) at IN_FLIGHT at once, after
    WARMUP: how many were made, and the server's RSS every SAMPLE_EVERY calls, from the first
    to the last."""
    body = image_body()
    samples: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        await asyncio.gather(*(predict(body, timeout=30) for _ in range(WARMUP)))
        samples.append(rss(pid))
        deadline = None if seconds is None else time.monotonic() + seconds
        left, done = calls, 0

        async def worker() -> None:
            nonlocal left, done
            while left > 0 and (deadline is None or time.monotonic() < deadline):
                left -= 1
                await predict(body, timeout=30)
                done += 1
                if done % SAMPLE_EVERY == 0:
                    samples.append(rss(pid))

        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    samples.append(rss(pid))
    return done, samples


def thirds(samples: Sequence[int]) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
    n = len(samples) // 3
    return samples[:n], samples[n : 2 * n], samples[2 * n :]


def test_rss_stays_flat_under_large_calls_at_32_in_flight(tmp_path: Path) -> None:
    model = tmp_path / "pool224.onnx"
    model.write_bytes(make_pool.build(224))
    with running(server_argv("--cache-entries", "0", node_id="rss", model=model)) as server:
        _, samples = asyncio.run(load(server.address, server.pid, CALLS))
    _, middle, last = thirds(samples)
    growth = (max(last) - max(middle)) / MIB
    shown = ", ".join(f"{s / MIB:.0f}" for s in samples)
    assert growth < GROWTH_MIB, f"RSS grew {growth:.0f} MiB in the last third: {shown} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.e2e.test_rss_flat_e2e", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "pool224.onnx"
        model.write_bytes(make_pool.build(224))
        with running(server_argv("--cache-entries", "0", node_id="rss", model=model)) as server:
            started = time.monotonic()
            calls, samples = asyncio.run(load(server.address, server.pid, 10**9, args.seconds))
            elapsed = time.monotonic() - started
    first, middle, last = thirds(samples)
    print(f"{calls} calls at {IN_FLIGHT} in flight in {elapsed:.0f} s")
    print(
        f"RSS MiB: start {samples[0] / MIB:.0f}, middle {samples[len(samples) // 2] / MIB:.0f},"
        f" end {samples[-1] / MIB:.0f}; peak of each third"
        f" {max(first) / MIB:.0f} / {max(middle) / MIB:.0f} / {max(last) / MIB:.0f}"
    )
    print(f"growth, second third to last: {(max(last) - max(middle)) / MIB:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
