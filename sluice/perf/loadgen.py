"""The load generator that runs inside each sweep process: closed-loop (fixed concurrency)
or open-loop (fixed arrival rate) calls with pre-serialized bodies, into an HDR histogram.

Open loop: arrivals follow a schedule and never wait for earlier responses; latency counts
from the scheduled send time, so a stall shows up in every call it delays (no coordinated
omission)."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from sluice.client import AsyncSluiceClient
from sluice.client.connect import PLAINTEXT, Connection
from sluice.client.core import auth_metadata
from sluice.core.datatypes import DATATYPES
from sluice.core.errors import status_name
from sluice.perf import histograms
from sluice.runtime.tls import aio_channel
from sluice.wire.mux import MuxStream, StreamBroken

Call = Callable[[bytes], Awaitable[str]]  # sends one body; returns the status name
Clock = Callable[[], float]
UNIQUE_ELEMENTS = 10  # base-100 digits of the call number: 10^20 distinct bodies


@dataclass(frozen=True)
class Bodies:
    """Request bodies to cycle through; with `unique_offset`, each call gets its own body by
    writing the call number into the first elements of the first input's raw data."""

    bodies: tuple[bytes, ...]
    unique_offset: int = -1
    unique_datatype: str = "FP32"
    unique_elements: int = UNIQUE_ELEMENTS  # fewer when the tensor is smaller

    def body(self, k: int) -> bytes:
        base = self.bodies[k % len(self.bodies)]
        if self.unique_offset < 0:
            return base
        dtype = DATATYPES[self.unique_datatype].dtype
        digits = [(k // 100**j) % 100 for j in range(self.unique_elements)]
        values = np.array(digits, np.float64) / 10 if dtype.kind == "f" else np.array(digits)
        patch = values.astype(dtype).tobytes()
        end = self.unique_offset + len(patch)
        return base[: self.unique_offset] + patch + base[end:]


@dataclass(frozen=True)
class LevelSpec:
    """One process's share of one level: `concurrency` workers or `rate` calls/s."""

    targets: tuple[str, ...]
    method: str
    bodies: Bodies
    call: str = "predict"  # or "stream": PredictStream, multiplexed
    embedded: bool = False  # balance over `targets` in the client
    concurrency: int = 0
    rate: float = 0.0
    total: int = 0  # calls; 0 means run for `duration`
    duration: float = 0.0
    warmup: float = 0.0
    connections: int = 1
    timeout: float = 10.0
    first_call: int = 0  # numbering offset, so processes send different unique bodies
    connection: Connection = PLAINTEXT  # TLS and API key


# Call numbering: a sweep starts at a random multiple of SWEEP_STRIDE, and level l, process i
# at l * LEVEL_STRIDE + i * PROCESS_STRIDE from there, so unique bodies do not repeat across
# processes, levels, or (but for a 1 in 10^6 chance) sweeps against the same server.
PROCESS_STRIDE = 10**10
LEVEL_STRIDE = 10**12
SWEEP_STRIDE = 10**14


@dataclass
class LevelResult:
    histogram: bytes = b""
    statuses: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_outstanding: int = 0  # open loop: calls sent but not yet answered, at most


async def closed_loop(
    call: Call,
    bodies: Bodies,
    *,
    concurrency: int,
    total: int,
    duration: float,
    clock: Clock = time.perf_counter,
    first_call: int = 0,
) -> LevelResult:
    """`concurrency` workers, each sending its next call when the last one returns."""
    result = LevelResult()
    histogram = histograms.new_histogram()
    stop_at = clock() + duration if duration else math.inf
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while (not total or issued < total) and clock() < stop_at:
            k = first_call + issued
            issued += 1
            started = clock()
            status = await call(bodies.body(k))
            histograms.record(histogram, clock() - started)
            result.statuses[status] += 1

    started = clock()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = clock() - started
    result.histogram = histogram.encode()
    return result


async def open_loop(
    call: Call,
    bodies: Bodies,
    *,
    rate: float,
    total: int,
    duration: float,
    clock: Clock = time.perf_counter,
    first_call: int = 0,
) -> LevelResult:
    """Calls at `rate` per second on a fixed schedule, whatever the responses do."""
    result = LevelResult()
    histogram = histograms.new_histogram()
    count = total or max(1, int(duration * rate))
    interval = 1.0 / rate
    outstanding: set[asyncio.Task[None]] = set()

    async def one(k: int, scheduled: float) -> None:
        status = await call(bodies.body(k))
        histograms.record(histogram, clock() - scheduled)
        result.statuses[status] += 1

    start = clock()
    for i in range(count):
        scheduled = start + i * interval
        delay = scheduled - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(first_call + i, scheduled))
        outstanding.add(task)  # held until done: a task nobody holds can be collected
        task.add_done_callback(outstanding.discard)
        result.max_outstanding = max(result.max_outstanding, len(outstanding))
    await asyncio.gather(*outstanding)
    result.wall_s = clock() - start
    result.histogram = histogram.encode()
    return result


def unary_call(
    channels: Sequence[grpc.aio.Channel], method: str, timeout: float, api_key: str = ""
) -> Call:
    """Unary calls over raw bytes, spreading them over the channels in turn."""
    metadata = auth_metadata(api_key) or None
    stubs = itertools.cycle(
        [
            ch.unary_unary(method, request_serializer=None, response_deserializer=None)
            for ch in channels
        ]
    )

    async def call(body: bytes) -> str:
        try:
            await next(stubs)(body, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
        return "OK"

    return call


def stream_call(streams_list: Sequence[MuxStream], timeout: float, api_key: str = "") -> Call:
    """Calls multiplexed on long-lived PredictStreams, one per connection."""
    streams = itertools.cycle(streams_list)
    metadata = dict(auth_metadata(api_key))  # each message's own metadata

    async def call(body: bytes) -> str:
        try:
            reply = await next(streams).call(body, metadata, timeout)
        except StreamBroken:
            return "UNAVAILABLE"
        except TimeoutError:
            return "DEADLINE_EXCEEDED"
        return status_name(reply.code)

    return call


def embedded_call(
    channels: Mapping[str, Sequence[grpc.aio.Channel]], timeout: float, api_key: str = ""
) -> Call:
    """Predict through the client core (AsyncSluiceClient) over the targets' channels: with
    several targets, its own balancing and the shared call planner, as SluiceClient does."""
    client = AsyncSluiceClient.on_channels(channels, timeout=timeout, api_key=api_key)

    async def call(body: bytes) -> str:
        reply = await client.call_raw(body, timeout=timeout)
        return status_name(reply.code)

    return call


async def run_level(spec: LevelSpec) -> LevelResult:
    tls = spec.connection.client_tls()
    # Separate subchannel pools: each channel is its own TCP connection.
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]
    channels = {
        target: [aio_channel(target, tls, options) for _ in range(spec.connections)]
        for target in spec.targets
    }
    api_key = spec.connection.api_key
    streams: list[MuxStream] = []
    try:
        first_target = channels[spec.targets[0]]
        if spec.embedded:
            call = embedded_call(channels, spec.timeout, api_key)
        elif spec.call == "stream":
            streams = [MuxStream(ch) for ch in first_target]
            call = stream_call(streams, spec.timeout, api_key)
        else:
            call = unary_call(first_target, spec.method, spec.timeout, api_key)

        async def phase(total: int, duration: float, first: int) -> LevelResult:
            if spec.rate:
                return await open_loop(
                    call,
                    spec.bodies,
                    rate=spec.rate,
                    total=total,
                    duration=duration,
                    first_call=first,
                )
            return await closed_loop(
                call,
                spec.bodies,
                concurrency=spec.concurrency,
                total=total,
                duration=duration,
                first_call=first,
            )

        first = spec.first_call
        if spec.warmup:  # its bodies are numbered too, so unique stays unique after it
            first += (await phase(0, spec.warmup, first)).statuses.total()
        cpu = time.process_time()
        result = await phase(spec.total, spec.duration, first)
        result.cpu_s = time.process_time() - cpu
        return result
    finally:
        for stream in streams:
            await stream.close()
        for chs in channels.values():
            for channel in chs:
                await channel.close(grace=None)


def ready(hold_s: float) -> int:
    """Pool warm-up task: holding each process briefly makes the pool start all of them."""
    time.sleep(hold_s)
    return os.getpid()


def run_level_in_process(spec: LevelSpec) -> LevelResult:
    """Entry point for sweep worker processes."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(run_level(spec))
