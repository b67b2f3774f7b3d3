"""The blocking driver: performs the core's steps on grpc's blocking channels."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self, Unpack

import grpc
import numpy as np

from sluice.client import core
from sluice.routing.pool import Backend
from sluice.runtime.tls import ClientTLS, blocking_channel
from sluice.v1 import inference_pb2 as pb
from sluice.wire import unary
from sluice.wire.mux import Reply


class Sent:
    """A blocking call sent as grpc's future (`.future`), read as the Reply the planner takes:
    a failure is its Reply, never raised, as an attempt's is."""

    __slots__ = ("_future",)

    def __init__(self, future: Any) -> None:
        self._future = future

    def add_done_callback(self, fn: Callable[[Sent], object]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def done(self) -> bool:
        return bool(self._future.done())

    def cancel(self) -> bool:
        return bool(self._future.cancel())

    def result(self, timeout: float | None = None) -> Reply:
        try:
            body: bytes = self._future.result(timeout)
        except grpc.RpcError as exc:
            return unary.failure(exc)
        return Reply(0, "", body, unary.pairs(self._future.trailing_metadata()))


class SluiceClient(core.Core):
    """The blocking client, on grpc's blocking channels (no event loop or thread of its own);
    safe to share between threads. Options and methods: as AsyncSluiceClient's."""

    def _open(self, target: str, security: ClientTLS | None, settings: core.ChannelOptions) -> Any:
        return blocking_channel(target, security, settings)

    def predict(
        self, inputs: core.Inputs, **options: Unpack[core.CallOptions]
    ) -> dict[str, np.ndarray]:
        return self.infer(inputs, **options).outputs

    def infer(self, inputs: core.Inputs, **options: Unpack[core.CallOptions]) -> core.Prediction:
        return self._run(self._infer(inputs, **options))

    def call_raw(
        self, body: bytes, metadata: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> Reply:
        return self._run(self._raw(body, metadata, timeout))

    def health(self, *, model: str = "", timeout: float | None = None) -> pb.HealthResponse:
        return self._run(self._health(model, timeout))

    def metadata(
        self, *, model: str = "", version: str = "", timeout: float | None = None
    ) -> pb.MetadataResponse:
        return self._run(self._metadata(model, version, self._deadline(timeout)))

    def close(self) -> None:
        self._run(self._unregister_all())
        for channel in itertools.chain(*self._channels.values()) if self._owned else ():
            channel.close()

    def _run(self, steps: core.Steps[core.T]) -> core.T:
        exchange = core.Exchange(steps)
        for step in exchange:
            try:
                exchange.answer = self._perform(step)
            except BaseException as exc:
                exchange.error = exc
        return exchange.value

    def _perform(self, step: core.Step) -> Any:
        if isinstance(step, core.Send):
            return self._routed(step)
        if isinstance(step, core.Unary):
            return getattr(self._stub, step.method)(
                step.request, timeout=step.timeout, metadata=self._auth
            )
        return self._explained(step)

    def _routed(self, send: core.Send) -> Reply:
        step = self._send if send.predict else self._ask
        if self._router is None:
            return step(self.target, send.body, send.metadata, send.terms.timeout)

        def attempt(backend: Backend, left: float | None) -> Reply:
            try:
                return step(backend.address, send.body, send.metadata, left)
            except grpc.RpcError as exc:
                return unary.failure(exc)  # for the planner to classify

        def start(backend: Backend, left: float | None) -> Sent:
            method: Any = self._method(send.predict, backend.address)
            return Sent(method.future(send.body, timeout=left, metadata=send.metadata))

        return self._router.run_sync(
            send.terms.key, send.terms.deadline, attempt, self._lock, start=start
        )

    def _send(
        self, target: str, body: bytes, metadata: core.Metadata, timeout: float | None
    ) -> Reply:
        """One Predict to one target: the transport step. Raises grpc.RpcError."""
        return unary.call_sync(self._method(True, target), body, metadata, timeout)

    def _ask(
        self, target: str, body: bytes, metadata: core.Metadata, timeout: float | None
    ) -> Reply:
        return unary.call_sync(self._method(False, target), body, metadata, timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
