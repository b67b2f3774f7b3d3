"""The fault suite's and the noisy-neighbour benchmark's load driver, run in load-generator
processes: closed loop, open loop or a burst over `loadgen.Bodies`, each call kept as a
Record with its latency by status and the node that answered it (the sweep's load
generator keeps one histogram for all statuses, which these scenarios cannot use)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import numpy as np

from sluice import models
from sluice.core.keys import PREDICT
from sluice.perf.loadgen import Bodies
from sluice.perf.sweep import make_bodies

HOST_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]


FAULT_TIMEOUT = 1.0  # the deadline of calls in the fault scenarios, seconds


class Record(NamedTuple):
    """One call: when it was due (monotonic, comparable across processes on Linux), its
    latency from then and from its actual send, its status, the node that answered (from
    `x-node-id`), and the kind of hostile body it carried ("" for a valid call)."""

    start: float
    latency: float
    wire: float
    status: str
    node: str
    kind: str


@dataclass(frozen=True)
class Drive:
    """One load-generator process's share of a load: closed loop (`concurrency`), open
    loop (`rate`), or `burst` (all `total` calls at once). Bounded by `total` and
    `duration`."""

    target: str
    bodies: Bodies
    concurrency: int = 0
    rate: float = 0.0
    burst: bool = False
    total: int = 1_000_000
    duration: float = 5.0
    timeout: float = FAULT_TIMEOUT
    first_call: int = 0
    start_at: float = 0.0  # time.monotonic() to begin at, so processes begin together
    connections: int = 1
    hostile: tuple[tuple[str, bytes], ...] = ()
    hostile_share: float = 0.0
    seed: int = 0
    metadata: tuple[tuple[str, str], ...] = ()  # sent with every call (an API key)


async def drive(spec: Drive) -> list[Record]:
    channels = [
        grpc.aio.insecure_channel(spec.target, options=HOST_OPTIONS)
        for _ in range(spec.connections)
    ]
    stubs = [
        ch.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        for ch in channels
    ]
    records: list[Record] = []
    rng = random.Random(spec.seed)
    try:
        for ch in channels:
            with suppress(TimeoutError):
                await asyncio.wait_for(ch.channel_ready(), 10)

        async def one(k: int, due: float) -> None:
            kind = ""
            body = b""
            if spec.hostile and rng.random() < spec.hostile_share:
                kind, body = spec.hostile[k % len(spec.hostile)]
            else:
                body = spec.bodies.body(k)
            sent = time.monotonic()
            pending = stubs[k % len(stubs)](
                body, timeout=spec.timeout, metadata=spec.metadata or None
            )
            status = "OK"
            try:
                await pending
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
            except asyncio.CancelledError:
                raise
            except Exception:  # a client-side failure is a status too, never a lost record
                status = "CLIENT_ERROR"
            node = ""
            with suppress(Exception):
                trailers = await pending.trailing_metadata()
                node = str(dict(trailers or ()).get("x-node-id", ""))
            done = time.monotonic()
            records.append(Record(due, done - due, done - sent, status, node, kind))

        if spec.start_at:
            await asyncio.sleep(max(0.0, spec.start_at - time.monotonic()))
        start = time.monotonic()
        stop_at = start + spec.duration
        if spec.burst:
            await asyncio.gather(*(one(spec.first_call + i, start) for i in range(spec.total)))
        elif spec.rate:
            count = min(spec.total, max(1, int(spec.duration * spec.rate)))
            tasks: set[asyncio.Task[None]] = set()
            for i in range(count):
                due = start + i / spec.rate
                if (delay := due - time.monotonic()) > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one(spec.first_call + i, due))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        else:
            issued = 0

            async def worker() -> None:
                nonlocal issued
                while issued < spec.total and time.monotonic() < stop_at:
                    k = spec.first_call + issued
                    issued += 1
                    await one(k, time.monotonic())

            await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    finally:
        for ch in channels:
            await ch.close(grace=None)
    return records


def drive_in_process(spec: Drive) -> tuple[list[Record], float]:
    """Entry point of the load-generator processes: the records, and the share of one core
    this process used meanwhile (near 1: the client, not the target, was the limit)."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    cpu, wall = time.process_time(), time.monotonic()
    with asyncio.Runner(loop_factory=factory) as runner:
        records = runner.run(drive(spec))
    wall = time.monotonic() - max(wall, spec.start_at)
    return records, (time.process_time() - cpu) / wall if wall > 0 else 0.0


def collect(futures: Sequence[Future[Any]], timeout: float = 120.0) -> list[Record]:
    return collect_with_cpu(futures, timeout)[0]


def collect_with_cpu(
    futures: Sequence[Future[Any]], timeout: float = 120.0
) -> tuple[list[Record], float]:
    """Every load process's records, by start, and the busiest one's share of a core."""
    done, pending = wait_futures(futures, timeout=timeout)
    if pending:
        raise RuntimeError(f"{len(pending)} load processes did not finish in {timeout:.0f} s")
    records: list[Record] = []
    busiest = 0.0
    for f in done:
        part, cpu = f.result()
        records.extend(part)
        busiest = max(busiest, cpu)
    return sorted(records), busiest


def digits_bodies() -> Bodies:
    """The bundled digits samples, each call with values of its own (no cache answers)."""
    return make_bodies([s.input for s in models.samples()], "input", unique=True)


def mlp_bodies() -> Bodies:
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    return make_bodies([x], "input", unique=True)
