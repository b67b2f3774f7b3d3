"""The door of a draining program's unary calls: counted while they run, refused (UNAVAILABLE,
retryable elsewhere) once it closes, and the wait until the last reply has had time to be read.

Why the wait: grpc's `stop(grace)` closes each connection the moment its last call ends. A
caller still reading that reply has sent flow-control updates grpc does not read any more,
and a socket closed with unread bytes sends a reset: the caller's kernel then drops the
reply's tail it had not read yet, and the call fails UNAVAILABLE though it was answered. So
the program waits for its calls, and a moment past the last reply, before it stops grpc."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from typing import Any

import grpc

from sluice.core.errors import Unavailable
from sluice.core.keys import DRAINING, REFUSED_HEADER
from sluice.runtime.status import status_of

# Past the last reply, how long a draining program keeps its connections open. A reply's
# unread tail is what flow control lets out (a few MiB at most); a caller on a loaded host
# reads it in milliseconds, so a second is ample, and it is paid only after recent calls.
LINGER_S = 1.0

Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


class Gate:
    """Counts a program's calls in flight (unary calls and streams) and when the last ended;
    once closed, refuses new unary calls."""

    def __init__(self, refusal: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.refusal = refusal  # the words of a call refused once closed
        self.clock = clock
        self.closed = False
        self.in_flight = 0
        self.last_end = -float("inf")  # when the last call ended (its reply sent)
        self._quiet: asyncio.Event | None = None  # set as the last call ends, while draining

    def handlers(
        self, methods: Mapping[str, grpc.RpcMethodHandler[bytes, bytes]]
    ) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
        """`methods` with each unary handler behind the gate, and each stream counted while
        open (not refused: a stream ends itself on a drain, answering what it carries)."""
        return {name: self._gated(handler) for name, handler in methods.items()}

    def _gated(
        self, handler: grpc.RpcMethodHandler[bytes, bytes]
    ) -> grpc.RpcMethodHandler[bytes, bytes]:
        unary = handler.unary_unary is not None
        behavior: Behavior = handler.unary_unary if unary else handler.stream_stream  # type: ignore[assignment]
        if not inspect.iscoroutinefunction(behavior):
            return handler  # a generator stream: none of ours

        async def gated(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if self.closed and unary:
                context.set_trailing_metadata(((REFUSED_HEADER, DRAINING),))
                error = Unavailable(self.refusal)
                await context.abort(status_of(error), str(error))
            self.in_flight += 1
            try:
                return await behavior(request, context)
            finally:
                self.in_flight -= 1
                self.last_end = self.clock()
                if not self.in_flight and self._quiet is not None:
                    self._quiet.set()

        wrap = (
            grpc.unary_unary_rpc_method_handler if unary else grpc.stream_stream_rpc_method_handler
        )
        return wrap(
            gated,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def drain(self, seconds: float, linger: float = LINGER_S) -> float:
        """Close, wait until no call is in flight and `linger` has passed since the last one
        ended, all within `seconds`; the seconds left of them."""
        self.closed = True
        end = self.clock() + seconds
        if self.in_flight:
            self._quiet = asyncio.Event()
            with suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), seconds)
        wait = min(self.last_end + linger, end) - self.clock()
        if wait > 0:
            await asyncio.sleep(wait)
        return max(0.0, end - self.clock())
