"""Clients over raw-bytes gRPC calls. Tensors travel as raw little-endian bytes.

`AsyncSluiceClient` is the one client core: request building, routing and decoding. Given
one target (a server or a balancer) it sends each call straight there; given several
servers it balances them itself (proxyless), with the balancer's own pool, breakers,
retry budget and attempt loop (sluice.routing.planner), and no extra hop.
`SluiceClient` is a blocking layer over it: a private event loop in a daemon thread runs
the async client's coroutines.

Failures raise `grpc.RpcError`, in fact `grpc.aio.AioRpcError`, whose `code()` and
`details()` say what went wrong: with one target, grpc's own error for the call; with
several, the last attempt's status, or UNAVAILABLE with the reason no server could take it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

import grpc
import numpy as np

from sluice.core.keys import NO_CACHE_HEADER, NO_CACHE_VALUE, PREDICT, affinity_key
from sluice.routing.breaker import BreakerSettings
from sluice.routing.budget import RetryBudget
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Pool
from sluice.runtime.status import grpc_code
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec
from sluice.wire.mux import Reply

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ChannelOptions = Sequence[tuple[str, Any]]
Metadata = tuple[tuple[str, str], ...]
# Sends one raw Predict body on one channel (the targets' channels are used in turn).
Sender = Callable[..., Any]


@dataclass(frozen=True)
class Prediction:
    """A Predict answer: the outputs and the response metadata that came with them."""

    outputs: dict[str, np.ndarray]
    metadata: dict[str, str]

    @property
    def node_id(self) -> str:
        return self.metadata.get("x-node-id", "")

    @property
    def request_id(self) -> str:
        return self.metadata.get("x-request-id", "")


def channel_options(max_message_bytes: int, extra: ChannelOptions) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *extra,
    ]


def predict_request(
    inputs: Mapping[str, np.ndarray], outputs: Sequence[str] = ()
) -> pb.PredictRequest:
    return pb.PredictRequest(inputs=codec.encode_all(inputs), outputs=outputs)


def call_metadata(request_id: str | None, no_cache: bool = False) -> dict[str, str]:
    metadata = {"x-request-id": request_id or os.urandom(8).hex()}
    if no_cache:
        metadata[NO_CACHE_HEADER] = NO_CACHE_VALUE
    return metadata


def pairs(metadata: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in metadata or ()}


def failure(error: grpc.aio.AioRpcError) -> Reply:
    """A failed call as a Reply."""
    return Reply(
        error.code().value[0], error.details() or "", b"", pairs(error.trailing_metadata())
    )


def rpc_error(reply: Reply) -> grpc.aio.AioRpcError:
    """A failed Reply as the error grpc raises for a failed call."""
    return grpc.aio.AioRpcError(
        grpc_code(reply.code),
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*reply.trailers.items()),
        reply.message,
        None,
    )


def target_list(target: str | Sequence[str]) -> list[str]:
    targets = [target] if isinstance(target, str) else list(target)
    if not targets:
        raise ValueError("give at least one target")
    return targets


def router(targets: Sequence[str], breaker: BreakerSettings | None = None) -> Planner[Reply]:
    """The client's own balancing over several servers: a pool and a retry budget of its own,
    driven by the shared planner."""
    pool = Pool(breaker=breaker)
    pool.set_addresses(targets)
    return Planner(pool, RetryBudget(), Reply)


class AsyncSluiceClient:
    """asyncio client; create and use it inside a running event loop. One target is a server
    or a balancer; several targets are servers that this client balances itself."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: ChannelOptions = (),
    ) -> None:
        targets = target_list(target)
        settings = channel_options(max_message_bytes, options)
        self._start({t: [grpc.aio.insecure_channel(t, options=settings)] for t in targets}, timeout)
        self._owned = True

    @classmethod
    def on_channels(
        cls, channels: Mapping[str, Sequence[grpc.aio.Channel]], *, timeout: float | None = 10.0
    ) -> Self:
        """A client over channels the caller made and closes, several per target if it likes
        (used in turn); for the load generator's connection counts."""
        client = cls.__new__(cls)
        client._start({t: list(chs) for t, chs in channels.items()}, timeout)
        client._owned = False
        return client

    def _start(self, channels: dict[str, list[grpc.aio.Channel]], timeout: float | None) -> None:
        self.targets = target_list(list(channels))
        self.target = self.targets[0]
        self.timeout = timeout
        self._channels = channels
        self._stub = pb_grpc.InferenceStub(channels[self.target][0])
        self._senders: dict[str, Iterator[Sender]] = {
            t: itertools.cycle(
                [
                    ch.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
                    for ch in chs
                ]
            )
            for t, chs in channels.items()
        }
        self._router = router(self.targets) if len(self.targets) > 1 else None

    async def predict(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str | None = None,
        no_cache: bool = False,
    ) -> dict[str, np.ndarray]:
        """Run the model; returns its outputs by name. `no_cache` keeps the call out of the
        result cache (and out of cache-affinity routing)."""
        answer = await self.infer(
            inputs, outputs=outputs, timeout=timeout, request_id=request_id, no_cache=no_cache
        )
        return answer.outputs

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str | None = None,
        no_cache: bool = False,
    ) -> Prediction:
        """Run the model; returns its outputs with the response metadata."""
        body = predict_request(inputs, outputs).SerializeToString()
        reply = await self._call(body, call_metadata(request_id, no_cache), timeout)
        if reply.code:
            raise rpc_error(reply)
        response = pb.PredictResponse.FromString(reply.body)
        return Prediction(codec.decode_all(response.outputs), reply.trailers)

    async def call_raw(
        self,
        body: bytes,
        metadata: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """One Predict of a serialized PredictRequest; failures come back as the Reply's
        status, never raised. For the load generator."""
        try:
            return await self._call(body, metadata or {}, timeout)
        except grpc.aio.AioRpcError as exc:
            return failure(exc)

    async def _call(self, body: bytes, metadata: Mapping[str, str], timeout: float | None) -> Reply:
        """One Predict: straight to the one target (its errors raised as grpc raises them),
        or routed by the planner over several, each attempt with the time left."""
        timeout = timeout or self.timeout
        sent = tuple(metadata.items())
        if self._router is None:
            return await self._send(self.target, body, sent, timeout)
        deadline = None if timeout is None else self._router.clock() + timeout
        return await self._router.run(
            affinity_key(body, metadata),
            deadline,
            lambda backend, left: self._attempt(backend, body, sent, left),
        )

    async def _send(
        self, target: str, body: bytes, metadata: Metadata, timeout: float | None
    ) -> Reply:
        """One attempt on one target; raises grpc.aio.AioRpcError."""
        call = next(self._senders[target])(body, timeout=timeout, metadata=metadata)
        reply: bytes = await call
        return Reply(0, "", reply, pairs(await call.trailing_metadata()))

    async def _attempt(
        self, backend: Backend, body: bytes, metadata: Metadata, timeout: float | None
    ) -> Reply:
        """One attempt for the planner: a failure is a Reply to classify, not an error."""
        try:
            return await self._send(backend.address, body, metadata, timeout)
        except grpc.aio.AioRpcError as exc:
            return failure(exc)

    async def health(self, *, timeout: float | None = None) -> pb.HealthResponse:
        """The first target's Health."""
        response: pb.HealthResponse = await self._stub.Health(
            pb.HealthRequest(), timeout=timeout or self.timeout
        )
        return response

    async def metadata(self, *, timeout: float | None = None) -> pb.MetadataResponse:
        """The first target's model metadata."""
        response: pb.MetadataResponse = await self._stub.Metadata(
            pb.MetadataRequest(), timeout=timeout or self.timeout
        )
        return response

    async def close(self) -> None:
        if self._owned:
            for chs in self._channels.values():
                for channel in chs:
                    await channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


P = ParamSpec("P")
T = TypeVar("T")


def _blocking(
    method: Callable[Concatenate[AsyncSluiceClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[SluiceClient, P], T]:
    """The AsyncSluiceClient method, run to completion on the blocking client's loop."""

    def run(self: SluiceClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(method(self._core, *args, **kwargs))

    functools.update_wrapper(run, method)  # its name, docstring and __wrapped__
    return run


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _on_loop(make: Callable[[], T]) -> T:
    """`make()` called on the running loop (grpc.aio channels belong to the loop they are
    made on)."""
    return make()


class SluiceClient:
    """Blocking client with the same methods as AsyncSluiceClient, which does the work on a
    private event loop in a daemon thread. Safe to use from several threads at once."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: ChannelOptions = (),
    ) -> None:
        target_list(target)  # a bad argument fails here, before a thread starts
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=_serve, args=(self._loop,), name="sluice-client")
        thread.daemon = True
        thread.start()
        self._thread = thread
        # Forgotten without close(): at least the thread ends.
        self._finalizer = weakref.finalize(self, self._loop.call_soon_threadsafe, self._loop.stop)
        self._finalizer.atexit = False
        try:
            core = functools.partial(
                AsyncSluiceClient,
                target,
                timeout=timeout,
                max_message_bytes=max_message_bytes,
                options=options,
            )
            self._core = self._run(_on_loop(core))
        except BaseException:
            self._stop()
            raise

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(work, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted while waiting: the call stops too
            raise

    predict = _blocking(AsyncSluiceClient.predict)
    infer = _blocking(AsyncSluiceClient.infer)
    health = _blocking(AsyncSluiceClient.health)
    metadata = _blocking(AsyncSluiceClient.metadata)

    @property
    def targets(self) -> list[str]:
        return self._core.targets

    @property
    def target(self) -> str:
        return self._core.target

    @property
    def timeout(self) -> float | None:
        return self._core.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._core.timeout = value

    @property
    def _router(self) -> Planner[Reply] | None:
        return self._core._router

    def close(self) -> None:
        if not self._finalizer.alive:
            return
        try:
            self._run(self._core.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        if self._finalizer.alive:
            self._finalizer()  # stops the loop; the thread closes it
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
