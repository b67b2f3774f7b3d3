"""Many calls on one long-lived PredictStream: ids match replies, one writer task (a write
cancelled with its caller would cancel the stream), bounded in flight, a broken stream
replaced. Calls pending on one that breaks fail with StreamBroken: they may go elsewhere."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

import grpc

from sluice.wire.stream import read_response, write_request

log = logging.getLogger("sluice.mux")
METHOD = "/sluice.v1.Inference/PredictStream"
EOF = grpc.aio.EOF  # type: ignore[attr-defined]  # the stubs predate it


class StreamBroken(Exception):
    """The stream ended or failed before this call's reply."""


@dataclass
class Reply:
    code: int
    message: str = ""
    body: bytes = b""
    trailers: dict[str, str] = field(default_factory=dict)
    retryable: bool = False  # refused before any work
    sent: bool = True  # False: refused on this side: no word on the server


class _Generation:
    """One opened stream and the calls waiting on it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        # No request iterator: this side writes with call.write() from one task.
        self.call = channel.stream_stream(
            METHOD, request_serializer=None, response_deserializer=None
        )()  # type: ignore[call-arg]
        self.pending: dict[int, asyncio.Future[Reply]] = {}
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.broken = False
        self.writer = asyncio.create_task(self._write())
        self.reader = asyncio.create_task(self._read())

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self.outbox.get())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the reader sees the same failure and fails the pending calls

    async def _read(self) -> None:
        why = "the stream ended"
        try:
            while True:
                raw = await self.call.read()
                if raw is EOF:
                    break
                reply = read_response(cast(bytes, raw))
                if reply is None:
                    why = "a reply on the stream is not a valid sluice.v1.StreamResponse"
                    break
                waiter = self.pending.pop(reply.id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(
                        Reply(
                            reply.code,
                            reply.message,
                            reply.response,
                            reply.trailers,
                            reply.retryable,
                        )
                    )
        except grpc.aio.AioRpcError as exc:
            why = f"the stream failed: {exc.code().name}: {exc.details()}"
        finally:
            self.broken = True
            self.writer.cancel()
            # Close our half too: a server waits for it before it counts the call finished.
            self.call.cancel()
            for waiter in self.pending.values():
                if not waiter.done():
                    waiter.set_exception(StreamBroken(why))
            self.pending.clear()

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.reader, self.writer, return_exceptions=True)


def _expire(waiter: asyncio.Future[Reply]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class MuxStream:
    def __init__(self, channel: grpc.aio.Channel, *, max_in_flight: int = 256) -> None:
        self.channel = channel
        self._slots = asyncio.Semaphore(max_in_flight)
        self._ids = itertools.count(1)
        self._current: _Generation | None = None

    def _stream(self) -> _Generation:
        if self._current is None or self._current.broken:
            self._current = _Generation(self.channel)
        return self._current

    async def call(
        self, body: bytes, metadata: Mapping[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        """One call over the stream: a Predict, or what `method` names (StreamRequest.method,
        e.g. "ModelInfer"). Raises StreamBroken (no reply came) or TimeoutError."""
        async with self._slots:
            stream = self._stream()
            ident = next(self._ids)
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[Reply] = loop.create_future()
            stream.pending[ident] = waiter
            stream.outbox.put_nowait(write_request(ident, body, timeout or 0.0, metadata, method))
            # A timer that fails the waiter, not asyncio.timeout: that cancels and uncancels
            # the task, 3 us a call more (measured), on every call the balancer forwards.
            timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
            try:
                return await waiter
            finally:
                if timer is not None:
                    timer.cancel()
                stream.pending.pop(ident, None)

    async def close(self) -> None:
        if self._current is not None:
            await self._current.close()
