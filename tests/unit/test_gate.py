"""The drain's door: unary calls counted while they run and refused, retryable elsewhere, once
it closes; the drain waits for them, and a linger past the last reply, within its bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from sluice.core.keys import DRAINING, REFUSED_HEADER
from sluice.runtime.gate import Gate

SERVICE = "test.Gate"


ARRIVED: list[asyncio.Event] = []  # set as a Slow call begins, or a stream's message is read


async def _slow(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    ARRIVED[-1].set()
    await asyncio.sleep(float(request.decode()))
    return b"done " + request


async def _stream(requests: AsyncIterator[bytes], context: object) -> None:
    async for _ in requests:
        ARRIVED[-1].set()


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gate, grpc.aio.Channel]]:
    gate = Gate("node-t is draining")
    ARRIVED.append(asyncio.Event())
    server = grpc.aio.server()
    methods = {
        "Slow": grpc.unary_unary_rpc_method_handler(_slow),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream),
    }
    handlers = gate.handlers(methods)
    server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gate, channel
    finally:
        await server.stop(0)
        ARRIVED.clear()


async def test_a_closed_gate_refuses_new_calls_retryable_elsewhere(
    served: tuple[Gate, grpc.aio.Channel],
) -> None:
    gate, channel = served
    slow = channel.unary_unary(f"/{SERVICE}/Slow")
    assert await slow(b"0") == b"done 0"
    await gate.drain(0.0, linger=0.0)
    call = slow(b"0")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == "node-t is draining"
    assert (REFUSED_HEADER, DRAINING) in tuple(await call.trailing_metadata() or ())
    assert gate.in_flight == 0


async def test_drain_waits_for_calls_in_flight_then_lingers_past_the_last_reply(
    served: tuple[Gate, grpc.aio.Channel],
) -> None:
    gate, channel = served
    slow = channel.unary_unary(f"/{SERVICE}/Slow")
    call = asyncio.ensure_future(slow(b"0.3"))
    await asyncio.wait_for(ARRIVED[-1].wait(), 10)
    began = time.monotonic()
    left = await gate.drain(30.0, linger=0.2)
    waited = time.monotonic() - began
    assert call.done() and call.result() == b"done 0.3"
    assert gate.in_flight == 0
    assert time.monotonic() - gate.last_end >= 0.2  # the linger ran past the reply
    assert waited >= 0.2
    assert 0 < left <= 30.0 - waited + 0.01


async def test_drain_is_bounded_by_its_seconds_with_a_call_still_running(
    served: tuple[Gate, grpc.aio.Channel],
) -> None:
    gate, channel = served
    call = asyncio.ensure_future(channel.unary_unary(f"/{SERVICE}/Slow")(b"30"))
    await asyncio.wait_for(ARRIVED[-1].wait(), 10)
    began = time.monotonic()
    assert await gate.drain(0.2, linger=5.0) == 0.0
    assert 0.2 <= time.monotonic() - began < 5.0
    assert gate.in_flight == 1
    call.cancel()


async def test_an_open_stream_is_waited_for_and_not_refused(
    served: tuple[Gate, grpc.aio.Channel],
) -> None:
    gate, channel = served
    stream = channel.stream_stream(f"/{SERVICE}/Stream")()
    await stream.write(b"one")
    await asyncio.wait_for(ARRIVED[-1].wait(), 10)
    draining = asyncio.ensure_future(gate.drain(30.0, linger=0.0))
    await asyncio.sleep(0.1)
    assert not draining.done()  # the stream is still open
    await stream.write(b"two")  # a stream open before the drain still carries messages
    await stream.done_writing()
    assert await stream.code() == grpc.StatusCode.OK
    assert await asyncio.wait_for(draining, 10) > 0
    assert gate.in_flight == 0


async def test_an_idle_gate_drains_at_once() -> None:
    gate = Gate("draining")
    began = time.monotonic()
    assert await gate.drain(10.0) == pytest.approx(10.0, abs=0.5)
    assert time.monotonic() - began < 0.5
