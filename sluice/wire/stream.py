"""PredictStream framing and serving, shared by the server and the balancer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from google.protobuf.message import DecodeError

from sluice.core.errors import Code
from sluice.v1 import inference_pb2 as pb

# The answer to bytes that are not a StreamRequest: the stream cannot be trusted any more,
# so the sender is told with id 0 and the stream ends once earlier calls are answered.
BAD_MESSAGE = pb.StreamResponse(
    id=0,
    code=Code.INVALID_ARGUMENT,
    message="a message on the stream is not a valid sluice.v1.StreamRequest; the stream ends",
).SerializeToString()


def parse_request(raw: bytes) -> pb.StreamRequest | None:
    try:
        return pb.StreamRequest.FromString(raw)
    except DecodeError:
        return None


async def serve(
    requests: AsyncIterator[bytes],
    write: Callable[[bytes], Awaitable[None]],
    answer: Callable[[pb.StreamRequest], Awaitable[bytes]],
    *,
    refuse: Callable[[pb.StreamRequest], bytes | None] = lambda message: None,
    stop: asyncio.Event | None = None,
) -> None:
    """The receiving side of PredictStream: each message is answered in its own task, and
    the replies are written in completion order by this one writer (grpc.aio allows one
    pending write per stream). `refuse` may answer a message at once instead. The stream
    ends when the sender closes it, sends garbage, or `stop` is set, once every call read
    so far is answered."""
    replies: asyncio.Queue[bytes | None] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()

    async def one(message: pb.StreamRequest) -> None:
        replies.put_nowait(await answer(message))

    async def read() -> None:
        async for raw in requests:
            message = parse_request(raw)
            if message is None:
                replies.put_nowait(BAD_MESSAGE)
                return
            refusal = refuse(message)
            if refusal is not None:
                replies.put_nowait(refusal)
                continue
            task = asyncio.create_task(one(message))
            running.add(task)  # held until done: a task nobody holds can be collected
            task.add_done_callback(running.discard)

    async def finish() -> None:
        waiting: list[asyncio.Future[object]] = [asyncio.ensure_future(read())]
        if stop is not None:
            waiting.append(asyncio.ensure_future(stop.wait()))
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in waiting:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        replies.put_nowait(None)

    finishing = asyncio.create_task(finish())
    try:
        while (reply := await replies.get()) is not None:
            await write(reply)
    finally:
        finishing.cancel()
        for task in running:
            task.cancel()
