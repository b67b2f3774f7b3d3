"""PredictStream framing and serving, shared by the server and the balancer."""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from typing import NamedTuple

from google.protobuf.message import DecodeError, Message

from sluice.core.errors import Code
from sluice.v1 import inference_pb2 as pb
from sluice.wire import facts, peek

# A stream message's bytes beyond its body and its map's text, at their widest.
ENVELOPE = 1024
PAIR = 18
UTF8 = 4  # the most bytes a character takes
WIDEST_ID = 0xFFFF_FFFF_FFFF_FFFF


def near(limit: int, body: bytes, pairs: Iterable[tuple[str, str]]) -> bool:
    """Whether a message of `body` and `pairs` may be over `limit` (0: none): only then is it
    worth measuring."""
    room = limit - len(body) - ENVELOPE
    if not limit or room < 0:
        return bool(limit)
    for key, value in pairs:
        room -= UTF8 * (len(key) + len(value)) + PAIR
    return room < 0


def framed(head: Message, body: bytes) -> int:
    """The bytes of `head` with `body` as its request or response, without copying it in
    (both fields are numbered under 16: one-byte tags)."""
    return head.ByteSize() + (1 + (len(body).bit_length() + 6) // 7 + len(body) if body else 0)


def response_size(
    limit: int, ident: int, body: bytes, trailers: Collection[tuple[str, str]]
) -> int:
    """The bytes of this StreamResponse when over `limit` (0: none), else 0."""
    if not near(limit, body, trailers):
        return 0
    size = framed(pb.StreamResponse(id=ident, trailers=dict(trailers)), body)
    return size if size > limit else 0


def request_size(
    limit: int, body: bytes, metadata: Mapping[str, str], timeout: float | None, method: str
) -> int:
    """The bytes of the StreamRequest for `body` (id at its widest) when over `limit`, else 0."""
    if not near(limit, body, metadata.items()):
        return 0
    head = pb.StreamRequest(
        id=WIDEST_ID, timeout_s=timeout or 0.0, metadata=metadata, method=method
    )
    size = framed(head, body)
    return size if size > limit else 0


# Written by hand, and large ones read by hand: protobuf's copies made 4 body-sized blocks
# per 602 KB call the balancer forwards, where a join or a slice makes one.


class Request(NamedTuple):
    """A StreamRequest as read. `request` is a slice, not a view, so it sits as aligned as
    its sender wrote it."""

    id: int
    request: bytes
    timeout_s: float
    metadata: dict[str, str]
    method: str


class Response(NamedTuple):
    """A StreamResponse as read off the wire; `response` a slice of the message."""

    id: int
    code: int
    message: str
    response: bytes
    trailers: dict[str, str]
    retryable: bool


_DOUBLE = struct.Struct("<d")
_INT32 = 1 << 31
_U64 = (1 << 64) - 1  # a negative int32 is written as 64-bit two's complement


_REQUEST_ID = peek.tag(facts.STREAM_REQUEST_ID, 0)
_REQUEST_BODY = peek.tag(facts.STREAM_REQUEST_BODY, 2)
_REQUEST_TIMEOUT = peek.tag(facts.STREAM_REQUEST_TIMEOUT, 1)
_REQUEST_METADATA = peek.tag(facts.STREAM_REQUEST_METADATA, 2)
_REQUEST_METHOD = peek.tag(facts.STREAM_REQUEST_METHOD, 2)
_RESPONSE_ID = peek.tag(facts.STREAM_RESPONSE_ID, 0)
_RESPONSE_CODE = peek.tag(facts.STREAM_RESPONSE_CODE, 0)
_RESPONSE_MESSAGE = peek.tag(facts.STREAM_RESPONSE_MESSAGE, 2)
_RESPONSE_BODY = peek.tag(facts.STREAM_RESPONSE_BODY, 2)
_RESPONSE_TRAILERS = peek.tag(facts.STREAM_RESPONSE_TRAILERS, 2)
_RESPONSE_RETRYABLE = peek.tag(facts.STREAM_RESPONSE_RETRYABLE, 0)
_ENTRY_KEY = peek.tag(facts.ENTRY_KEY, 2)
_ENTRY_VALUE = peek.tag(facts.ENTRY_VALUE, 2)


def _pairs(parts: list[bytes], tag: bytes, pairs: Iterable[tuple[str, str]]) -> None:
    for key, value in pairs:
        k, v = key.encode(), value.encode()
        entry = _ENTRY_KEY + peek.varint(len(k)) + k + _ENTRY_VALUE + peek.varint(len(v)) + v
        parts += (tag, peek.varint(len(entry)), entry)


def _text(parts: list[bytes], tag: bytes, text: str) -> None:
    if text:
        value = text.encode()
        parts += (tag, peek.varint(len(value)), value)


def write_request(
    ident: int, body: bytes, timeout_s: float, metadata: Mapping[str, str], method: str
) -> bytes:
    """A StreamRequest's bytes, as protobuf writes them: `body` copied once, by the join."""
    parts = [_REQUEST_ID, peek.varint(ident)] if ident else []
    if body:
        parts += (_REQUEST_BODY, peek.varint(len(body)), body)
    if timeout_s or math.copysign(1.0, timeout_s) < 0:  # -0.0 is written, as protobuf does
        parts += (_REQUEST_TIMEOUT, _DOUBLE.pack(timeout_s))
    _pairs(parts, _REQUEST_METADATA, metadata.items())
    _text(parts, _REQUEST_METHOD, method)
    return b"".join(parts)


def write_response(
    ident: int,
    body: bytes = b"",
    code: int = 0,
    message: str = "",
    trailers: Iterable[tuple[str, str]] = (),
    retryable: bool = False,
) -> bytes:
    """A StreamResponse's bytes, as protobuf writes them: `body` copied once, by the join."""
    parts = [_RESPONSE_ID, peek.varint(ident)] if ident else []
    if code:
        parts += (_RESPONSE_CODE, peek.varint(code & _U64))
    _text(parts, _RESPONSE_MESSAGE, message)
    if body:
        parts += (_RESPONSE_BODY, peek.varint(len(body)), body)
    _pairs(parts, _RESPONSE_TRAILERS, trailers)
    if retryable:
        parts += (_RESPONSE_RETRYABLE, peek.varint(1))
    return b"".join(parts)


def _entry(raw: bytes, start: int, end: int, into: dict[str, str]) -> None:
    """A map entry's key and value into `into`; an entry with any other field is no pair
    (the parser keeps it as an unknown field)."""
    key = value = ""
    pair = True
    for number, wire, a, b in peek.fields(raw, start, end):  # all of it: it must parse
        if number == facts.ENTRY_KEY and wire == 2:
            key = raw[a:b].decode()
        elif number == facts.ENTRY_VALUE and wire == 2:
            value = raw[a:b].decode()
        else:
            pair = False
    if pair:
        into[key] = value


def read_request(raw: bytes) -> Request | None:
    """The StreamRequest in `raw` (None: not one); large ones read by hand."""
    if len(raw) >= peek.WIRE_READ_FROM:
        return wire_request(raw)
    try:
        got = pb.StreamRequest.FromString(raw)
    except DecodeError:
        return None
    return Request(got.id, got.request, got.timeout_s, dict(got.metadata), got.method)


def read_response(raw: bytes) -> Response | None:
    """The StreamResponse in `raw` (None: not one); large ones read by hand."""
    if len(raw) >= peek.WIRE_READ_FROM:
        return wire_response(raw)
    try:
        got = pb.StreamResponse.FromString(raw)
    except DecodeError:
        return None
    return Response(got.id, got.code, got.message, got.response, dict(got.trailers), got.retryable)


def wire_request(raw: bytes) -> Request | None:
    """The StreamRequest in `raw` read off the wire as protobuf parses it; None where it
    refuses it, or for a group or more than peek.MAX_FIELDS fields."""
    ident, body, timeout, method = 0, b"", 0.0, ""
    metadata: dict[str, str] = {}
    try:
        for number, wire, a, b in peek.fields(raw, 0, len(raw)):
            if number == facts.STREAM_REQUEST_BODY and wire == 2:
                body = raw[a:b]
            elif number == facts.STREAM_REQUEST_ID and wire == 0:
                ident = a
            elif number == facts.STREAM_REQUEST_TIMEOUT and wire == 1:
                timeout = _DOUBLE.unpack_from(raw, a)[0]
            elif number == facts.STREAM_REQUEST_METADATA and wire == 2:
                _entry(raw, a, b, metadata)
            elif number == facts.STREAM_REQUEST_METHOD and wire == 2:
                method = raw[a:b].decode()
    except (peek.Malformed, UnicodeDecodeError):
        return None
    return Request(ident, body, timeout, metadata, method)


def wire_response(raw: bytes) -> Response | None:
    """The StreamResponse in `raw` read off the wire; None as `wire_request`."""
    ident, code, message, body, retryable = 0, 0, "", b"", False
    trailers: dict[str, str] = {}
    try:
        for number, wire, a, b in peek.fields(raw, 0, len(raw)):
            if number == facts.STREAM_RESPONSE_BODY and wire == 2:
                body = raw[a:b]
            elif number == facts.STREAM_RESPONSE_ID and wire == 0:
                ident = a
            elif number == facts.STREAM_RESPONSE_CODE and wire == 0:
                code = (a & 0xFFFF_FFFF ^ _INT32) - _INT32  # int32: its low 32 bits
            elif number == facts.STREAM_RESPONSE_MESSAGE and wire == 2:
                message = raw[a:b].decode()
            elif number == facts.STREAM_RESPONSE_TRAILERS and wire == 2:
                _entry(raw, a, b, trailers)
            elif number == facts.STREAM_RESPONSE_RETRYABLE and wire == 0:
                retryable = bool(a)
    except (peek.Malformed, UnicodeDecodeError):
        return None
    return Response(ident, code, message, body, trailers, retryable)


# Id 0: the stream is no longer trusted, and ends once earlier calls are answered.
BAD_MESSAGE = write_response(
    0,
    code=Code.INVALID_ARGUMENT,
    message="a message on the stream is not a valid sluice.v1.StreamRequest; the stream ends",
)


# Calls read but not yet written; at the bound HTTP/2 flow control pushes back. Equal to
# the balancer's --stream-max-in-flight, so a server never holds its stream below that.
MAX_PENDING = 512


async def serve(
    requests: AsyncIterator[bytes],
    write: Callable[[bytes], Awaitable[None]],
    answer: Callable[[Request], Awaitable[bytes]],
    *,
    refuse: Callable[[Request], bytes | None] = lambda message: None,
    stop: asyncio.Event | None = None,
    max_pending: int = MAX_PENDING,
) -> None:
    """The receiving side of PredictStream: each message answered in its own task (or at once
    by `refuse`), replies written in completion order by one writer (grpc.aio allows one
    pending write), at most `max_pending` unwritten. Ends when the sender closes, sends
    garbage, or `stop` is set, once every call read is answered."""
    if max_pending < 1:
        raise ValueError(f"max_pending must be at least 1, not {max_pending}")
    replies: asyncio.Queue[bytes | None] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()
    slots = asyncio.Semaphore(max_pending)

    async def one(message: Request) -> None:
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
            message = read_request(raw)
            if message is None:
                replies.put_nowait(BAD_MESSAGE)
                return
            refusal = refuse(message)
            if refusal is not None:
                replies.put_nowait(refusal)
                continue
            task = asyncio.create_task(one(message))
            running.add(task)  # a task nobody holds can be collected
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
