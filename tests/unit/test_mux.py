"""Calls multiplexed on one PredictStream (sluice.wire.mux) against a real grpc.aio server on
127.0.0.1 that answers each message by its id, or holds the ones it is told to: a reply
reaches its own caller in any order, a call past its time raises TimeoutError and leaves the
stream to the others, and a reply that is no StreamResponse ends the stream as broken."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from sluice.v1 import inference_pb2 as pb
from sluice.wire.mux import MuxStream, StreamBroken

HOLD = "hold"  # a message with this method is never answered
GARBAGE = "garbage"  # ... answered with bytes that are no StreamResponse


async def answer(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
    async for raw in requests:
        message = pb.StreamRequest.FromString(raw)
        if message.method == HOLD:
            continue
        if message.method == GARBAGE:
            await context.write(b"\xff\xff\xff")
            continue
        reply = pb.StreamResponse(
            id=message.id, response=message.request, trailers=dict(message.metadata)
        )
        await context.write(reply.SerializeToString())


def run(test: Callable[[MuxStream], Awaitable[None]]) -> None:
    """`test` on a MuxStream to a server on this loop, both closed afterwards."""

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(answer)
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "sluice.v1.Inference", {"PredictStream": handler}
                )
            ]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                mux = MuxStream(channel)
                try:
                    await test(mux)
                finally:
                    await mux.close()
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_replies_reach_their_callers_with_and_without_a_deadline() -> None:
    async def test(mux: MuxStream) -> None:
        replies = await asyncio.gather(
            *(mux.call(b"x%d" % i, {"k": str(i)}, 10.0 if i % 2 else None) for i in range(20))
        )
        assert [(r.body, r.trailers) for r in replies] == [
            (b"x%d" % i, {"k": str(i)}) for i in range(20)
        ]

    run(test)


def test_a_call_past_its_time_raises_and_the_stream_serves_the_next() -> None:
    async def test(mux: MuxStream) -> None:
        with pytest.raises(TimeoutError):
            await mux.call(b"held", {}, 0.05, HOLD)
        stream = mux._current
        assert stream is not None and stream.pending == {}  # nothing left waiting
        assert (await mux.call(b"next", {}, 10.0)).body == b"next"
        assert mux._current is stream  # the same stream

    run(test)


def test_a_reply_that_is_no_stream_response_breaks_the_stream() -> None:
    async def test(mux: MuxStream) -> None:
        with pytest.raises(StreamBroken, match=r"not a valid sluice\.v1\.StreamResponse"):
            await mux.call(b"", {}, 10.0, GARBAGE)
        assert (await mux.call(b"again", {}, 10.0)).body == b"again"  # a new stream

    run(test)
