"""One raw-bytes unary call as the Reply the planner reads (blocking and asyncio)."""

from __future__ import annotations

from typing import Any, Protocol

import grpc

from sluice.core.keys import REFUSED_HEADER
from sluice.wire.mux import Reply

Metadata = tuple[tuple[str, str], ...]


class Failed(Protocol):
    """A failed call as grpc raises it (grpc.RpcError of either API)."""

    def code(self) -> grpc.StatusCode: ...

    def details(self) -> str | None: ...

    def trailing_metadata(self) -> Any: ...


def pairs(metadata: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in metadata or ()}


def failure(error: Failed) -> Reply:
    """A failed call as a Reply; one its server refused before any work is retryable."""
    trailers = pairs(error.trailing_metadata())
    return Reply(
        error.code().value[0], error.details() or "", b"", trailers, REFUSED_HEADER in trailers
    )


async def call(method: Any, body: bytes, metadata: Metadata, timeout: float | None) -> Reply:
    """One call of a raw-bytes grpc.aio unary method; raises grpc.aio.AioRpcError."""
    pending = method(body, timeout=timeout, metadata=metadata)
    reply: bytes = await pending
    return Reply(0, "", reply, pairs(await pending.trailing_metadata()))


async def attempt(method: Any, body: bytes, metadata: Metadata, timeout: float | None) -> Reply:
    """One call whose failure comes back as its Reply, never raised."""
    try:
        return await call(method, body, metadata, timeout)
    except grpc.aio.AioRpcError as exc:
        return failure(exc)


def call_sync(method: Any, body: bytes, metadata: Metadata, timeout: float | None) -> Reply:
    """`call` on a blocking channel; raises grpc.RpcError."""
    reply, done = method.with_call(body, timeout=timeout, metadata=metadata)
    return Reply(0, "", reply, pairs(done.trailing_metadata()))


def attempt_sync(method: Any, body: bytes, metadata: Metadata, timeout: float | None) -> Reply:
    """`attempt` on a blocking channel."""
    try:
        return call_sync(method, body, metadata, timeout)
    except grpc.RpcError as exc:
        return failure(exc)
