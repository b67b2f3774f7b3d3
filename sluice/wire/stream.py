"""PredictStream framing and serving, shared by the server and the balancer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from google.protobuf.message import DecodeError, Message

from sluice.core.errors import Code
from sluice.v1 import inference_pb2 as pb

# The answer to bytes that are not a StreamRequest: the stream cannot be trusted any more,
# so the sender is told with id 0 and the stream ends once earlier calls are answered.
BAD_MESSAGE = pb.StreamResponse(
    id=0,
    code=Code.INVALID_ARGUMENT,
    message="a message on the stream is not a valid sluice.v1.StreamRequest; the stream ends",
).SerializeToString()


# A stream message's bytes besides its body and its map's (metadata's, trailers') keys and
# values: its other fields (id at its widest, timeout, method, code, retryable; a refusal's
# message is no reply's) with their tags and lengths, and each map entry's own tags and
# lengths at their widest.
ENVELOPE = 1024
PAIR = 18
UTF8 = 4  # the most bytes a character takes


def near(limit: int, body: bytes, pairs: Mapping[str, str]) -> bool:
    """Whether a stream message that carries `body` and `pairs` may be over `limit` (0: no
    limit): only then is it worth measuring (`framed`). The body first: far under the limit,
    only the map's few pairs are added up."""
    room = limit - len(body) - ENVELOPE
    if not limit or room < 0:
        return bool(limit)
    for key, value in pairs.items():
        room -= UTF8 * (len(key) + len(value)) + PAIR
    return room < 0


def framed(head: Message, body: bytes) -> int:
    """The bytes of `head` once `body` is its request (StreamRequest) or response
    (StreamResponse), counted without copying `body` in: the size a message limit applies
    to. Both fields are numbered under 16, so their tag is one byte."""
    return head.ByteSize() + (1 + (len(body).bit_length() + 6) // 7 + len(body) if body else 0)


def parse_request(raw: bytes) -> pb.StreamRequest | None:
    try:
        return pb.StreamRequest.FromString(raw)
    except DecodeError:
        return None


# Calls a stream may hold read but not yet written, running or awaiting the writer. At the
# bound the stream stops reading, so HTTP/2 flow control pushes back on a sender that writes
# faster than it reads. It matches the balancer's calls in flight on one upstream stream
# (--stream-max-in-flight), so a balancer's stream to a server is not held below its own bound.
MAX_PENDING = 512


async def serve(
    requests: AsyncIterator[bytes],
    write: Callable[[bytes], Awaitable[None]],
    answer: Callable[[pb.StreamRequest], Awaitable[bytes]],
    *,
    refuse: Callable[[pb.StreamRequest], bytes | None] = lambda message: None,
    stop: asyncio.Event | None = None,
    max_pending: int = MAX_PENDING,
) -> None:
    """The receiving side of PredictStream: each message is answered in its own task, and
    the replies are written in completion order by this one writer (grpc.aio allows one
    pending write per stream). `refuse` may answer a message at once instead. At most
    `max_pending` messages are read and not yet answered and written: at the bound the next
    message is read only once a reply is written. The stream ends when the sender closes it,
    sends garbage, or `stop` is set, once every call read so far is answered."""
    if max_pending < 1:
        raise ValueError(f"max_pending must be at least 1, not {max_pending}")
    replies: asyncio.Queue[bytes | None] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()
    # One slot per message read and not yet written; the writer frees it.
    slots = asyncio.Semaphore(max_pending)

    async def one(message: pb.StreamRequest) -> None:
        try:
            reply = await answer(message)
        except BaseException:
            slots.release()  # no reply will be written for it
            raise
        replies.put_nowait(reply)

    async def read() -> None:
        while True:
            await slots.acquire()
            try:
                raw = await requests.__anext__()
            except StopAsyncIteration:
                return
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
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the stream is cancelled: the reader must not outlive it
            for task in waiting:
                task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        replies.put_nowait(None)

    finishing = asyncio.create_task(finish())
    try:
        while (reply := await replies.get()) is not None:
            await write(reply)
            slots.release()
    finally:
        finishing.cancel()
        for task in running:
            task.cancel()
