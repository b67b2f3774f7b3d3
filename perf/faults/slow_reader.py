"""slow-reader: PredictStream callers that write and never read, at a server and at the
balancer, while others' calls go on."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import suppress
from typing import Any

import grpc
import numpy as np

from perf.bench import Bench, rss_mb, sleep_until
from perf.drive import collect, digits_bodies
from perf.faults.results import Outcome, summarize
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

STREAM = "/sluice.v1.Inference/PredictStream"


async def slow_read(address: str, body: bytes, until: float, stats: dict[str, Any]) -> None:
    """Write stream messages and never read a reply, until `until` (or 20,000 messages)."""
    options = [("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        method = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
        call = method(None)
        stats["written"] = 0

        async def write() -> None:
            for i in range(1, 20_001):
                message = pb.StreamRequest(id=i, request=body, timeout_s=60)
                await call.write(message.SerializeToString())
                stats["written"] = i
                stats["last_write"] = time.monotonic()

        writer = asyncio.create_task(write())
        try:
            await asyncio.wait_for(asyncio.shield(writer), max(0.0, until - time.monotonic()))
        except TimeoutError:
            pass
        except grpc.aio.AioRpcError as exc:
            stats["error"] = exc.code().name
        finally:
            writer.cancel()
            call.cancel()
            with suppress(BaseException):
                await writer


def slow_reader(bench: Bench) -> Outcome:
    outcome = Outcome("slow-reader", "PredictStream callers that write and never read")
    server = bench.server("slow-s0")
    balancer = bench.balancer([server.address])
    x = np.random.default_rng(5).uniform(0, 16, (32, 64)).astype(np.float32)
    body = pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString()
    window = bench.seconds(10.0, 4.0)
    pids = {"server": server.pid, "balancer": balancer.pid}
    before = {k: rss_mb(p) or 0.0 for k, p in pids.items()}
    peak = dict(before)
    t0 = time.monotonic() + 0.3
    until = t0 + window
    # Valid calls from others while the readers stall: do they still get through?
    futures = bench.load(
        balancer.address, concurrency=2, duration=window, start_at=t0, bodies=digits_bodies()
    )
    stats: dict[str, dict[str, Any]] = {"server": {}, "balancer": {}}

    async def both() -> None:
        await asyncio.gather(
            slow_read(server.address, body, until, stats["server"]),
            slow_read(balancer.address, body, until, stats["balancer"]),
        )

    runner = threading.Thread(target=lambda: asyncio.run(both()), daemon=True)
    sleep_until(t0)
    runner.start()
    while runner.is_alive() and time.monotonic() < until + 10:
        for k, p in pids.items():
            peak[k] = max(peak[k], rss_mb(p) or 0.0)
        runner.join(timeout=0.25)
    at_end = {k: rss_mb(p) or 0.0 for k, p in pids.items()}
    records = collect(futures)
    outcome.rows = [summarize("others' calls via balancer", records)]
    time.sleep(1.0)  # the readers are gone: memory held for them should be released
    released = {k: rss_mb(p) or 0.0 for k, p in pids.items()}
    for k in pids:
        s = stats[k]
        stall = s.get("last_write", t0) - t0
        outcome.facts[f"{k}: messages taken before the stall"] = (
            f"{s.get('written', 0)} (last write {stall:.1f} s in; {s.get('error', 'no error')})"
        )
        outcome.facts[f"{k}: RSS MB before / peak / end / 1 s later"] = (
            f"{before[k]:.0f} / {peak[k]:.0f} / {at_end[k]:.0f} / {released[k]:.0f}"
        )
    growth = {k: peak[k] - before[k] for k in pids}
    outcome.rss_mb = bench.rss()
    outcome.goals = {
        "server RSS growth < 50 MB": growth["server"] < 50,
        "balancer RSS growth < 50 MB": growth["balancer"] < 50,
        "others' calls all OK": all(r.status == "OK" for r in records),
        "writers held back (< 20,000 messages taken)": all(
            stats[k].get("written", 0) < 20_000 for k in pids
        ),
    }
    outcome.headline = (
        f"RSS growth server {growth['server']:.0f} MB, balancer {growth['balancer']:.0f} MB"
    )
    return outcome
