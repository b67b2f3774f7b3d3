"""The asyncio driver: performs the core's steps on grpc.aio channels."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self, Unpack

import grpc
import numpy as np

from sluice.client import core
from sluice.routing.pool import Backend
from sluice.runtime.tls import ClientTLS, aio_channel
from sluice.v1 import inference_pb2 as pb
from sluice.wire import unary
from sluice.wire.mux import Reply


class AsyncSluiceClient(core.Core):
    """The asyncio client (create and use it inside a running event loop); options: `Core`."""

    def _open(self, target: str, security: ClientTLS | None, settings: core.ChannelOptions) -> Any:
        return aio_channel(target, security, settings)

    async def predict(
        self, inputs: core.Inputs, **options: Unpack[core.CallOptions]
    ) -> dict[str, np.ndarray]:
        """`infer`'s outputs by name."""
        return (await self.infer(inputs, **options)).outputs

    async def infer(
        self, inputs: core.Inputs, **options: Unpack[core.CallOptions]
    ) -> core.Prediction:
        """Run the model; its outputs with the response metadata (`Core._infer`)."""
        return await self._run(self._infer(inputs, **options))

    async def call_raw(
        self, body: bytes, metadata: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> Reply:
        """One Predict of a serialized PredictRequest; a failure is the Reply's status."""
        return await self._run(self._raw(body, metadata, timeout))

    async def health(self, *, model: str = "", timeout: float | None = None) -> pb.HealthResponse:
        """The first target's Health (a model's, when named)."""
        return await self._run(self._health(model, timeout))

    async def metadata(
        self, *, model: str = "", version: str = "", timeout: float | None = None
    ) -> pb.MetadataResponse:
        """A model's metadata (the default one unless named), from a target that answers."""
        return await self._run(self._metadata(model, version, self._deadline(timeout)))

    async def close(self) -> None:
        """Unregister the regions, then close the channels this client made."""
        await self._run(self._unregister_all())
        for channel in itertools.chain(*self._channels.values()) if self._owned else ():
            await channel.close(grace=None)

    async def _run(self, steps: core.Steps[core.T]) -> core.T:
        exchange = core.Exchange(steps)
        for step in exchange:
            try:
                exchange.answer = await self._perform(step)
            except BaseException as exc:
                exchange.error = exc
        return exchange.value

    async def _perform(self, step: core.Step) -> Any:
        if isinstance(step, core.Send):
            return await self._routed(step)
        if isinstance(step, core.Unary):
            stub = getattr(self._stub, step.method)
            return await stub(step.request, timeout=step.timeout, metadata=self._auth)
        return await asyncio.to_thread(self._explained, step)  # a probe blocks

    async def _routed(self, send: core.Send) -> Reply:
        step = self._send if send.predict else self._ask
        if self._router is None:
            return await step(self.target, send.body, send.metadata, send.terms.timeout)

        async def attempt(backend: Backend, left: float | None) -> Reply:
            try:
                return await step(backend.address, send.body, send.metadata, left)
            except grpc.aio.AioRpcError as exc:
                return unary.failure(exc)  # for the planner to classify

        return await self._router.run(send.terms.key, send.terms.deadline, attempt)

    async def _send(
        self, target: str, body: bytes, metadata: core.Metadata, timeout: float | None
    ) -> Reply:
        """One Predict to one target: the transport step. Raises grpc.aio.AioRpcError."""
        return await unary.call(self._method(True, target), body, metadata, timeout)

    async def _ask(
        self, target: str, body: bytes, metadata: core.Metadata, timeout: float | None
    ) -> Reply:
        return await unary.call(self._method(False, target), body, metadata, timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
