"""Clients on the generated stub. Tensors travel as raw little-endian bytes.

Failures raise `grpc.RpcError` (in asyncio, `grpc.aio.AioRpcError`) whose `code()` and
`details()` say what went wrong.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import grpc
import numpy as np

from sluice.client.routing import Router
from sluice.core.keys import NO_CACHE_HEADER, NO_CACHE_VALUE
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
Metadata = tuple[tuple[str, str], ...]


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


ChannelOptions = Sequence[tuple[str, Any]]


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


def call_metadata(request_id: str | None, no_cache: bool = False) -> Metadata:
    metadata: Metadata = (("x-request-id", request_id or os.urandom(8).hex()),)
    return (*metadata, (NO_CACHE_HEADER, NO_CACHE_VALUE)) if no_cache else metadata


def prediction(response: pb.PredictResponse, metadata: Iterable[Any] | None) -> Prediction:
    return Prediction(
        outputs=codec.decode_all(response.outputs),
        metadata={str(k): str(v) for k, v in metadata or ()},
    )


PREDICT = "/sluice.v1.Inference/Predict"


class SluiceClient:
    """Blocking client. One target is a server or a balancer; several targets are servers
    that this client balances itself (see client.routing), with no balancer hop."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: ChannelOptions = (),
    ) -> None:
        self.targets = [target] if isinstance(target, str) else list(target)
        if not self.targets:
            raise ValueError("give at least one target")
        self.target = self.targets[0]
        self.timeout = timeout
        self._channels = {
            t: grpc.insecure_channel(t, options=channel_options(max_message_bytes, options))
            for t in self.targets
        }
        self._stub = pb_grpc.InferenceStub(self._channels[self.target])
        self._router = Router(self.targets) if len(self.targets) > 1 else None
        self._predict = {
            t: ch.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
            for t, ch in self._channels.items()
        }

    def predict(
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
        return self.infer(
            inputs, outputs=outputs, timeout=timeout, request_id=request_id, no_cache=no_cache
        ).outputs

    def infer(
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
        metadata = call_metadata(request_id, no_cache)
        timeout = timeout or self.timeout
        if self._router is None:
            reply, call = self._predict[self.target].with_call(
                body, timeout=timeout, metadata=metadata
            )
            return prediction(pb.PredictResponse.FromString(reply), call.trailing_metadata())
        key, tried = self._router.first(body, dict(metadata))
        while True:
            attempt = self._router.next(key, tried)
            try:
                reply, call = self._predict[attempt.backend.address].with_call(
                    body, timeout=timeout, metadata=metadata
                )
            except grpc.RpcError as exc:
                if not self._router.failed(attempt, exc):
                    raise
                continue
            self._router.done(attempt)
            return prediction(pb.PredictResponse.FromString(reply), call.trailing_metadata())

    def health(self, *, timeout: float | None = None) -> pb.HealthResponse:
        """The first target's Health."""
        response: pb.HealthResponse = self._stub.Health(
            pb.HealthRequest(), timeout=timeout or self.timeout
        )
        return response

    def metadata(self, *, timeout: float | None = None) -> pb.MetadataResponse:
        response: pb.MetadataResponse = self._stub.Metadata(
            pb.MetadataRequest(), timeout=timeout or self.timeout
        )
        return response

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncSluiceClient:
    """asyncio client, like SluiceClient; create and use it inside a running event loop."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: ChannelOptions = (),
    ) -> None:
        self.targets = [target] if isinstance(target, str) else list(target)
        if not self.targets:
            raise ValueError("give at least one target")
        self.target = self.targets[0]
        self.timeout = timeout
        self._channels = {
            t: grpc.aio.insecure_channel(t, options=channel_options(max_message_bytes, options))
            for t in self.targets
        }
        self._stub = pb_grpc.InferenceStub(self._channels[self.target])
        self._router = Router(self.targets) if len(self.targets) > 1 else None
        self._predict = {
            t: ch.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
            for t, ch in self._channels.items()
        }

    async def predict(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str | None = None,
        no_cache: bool = False,
    ) -> dict[str, np.ndarray]:
        """Run the model; returns its outputs by name."""
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
        metadata = call_metadata(request_id, no_cache)
        timeout = timeout or self.timeout
        if self._router is None:
            return await self._send(self.target, body, metadata, timeout)
        key, tried = self._router.first(body, dict(metadata))
        while True:
            attempt = self._router.next(key, tried)
            try:
                answer = await self._send(attempt.backend.address, body, metadata, timeout)
            except grpc.aio.AioRpcError as exc:
                if not self._router.failed(attempt, exc):
                    raise
                continue
            self._router.done(attempt)
            return answer

    async def _send(
        self, target: str, body: bytes, metadata: Metadata, timeout: float | None
    ) -> Prediction:
        call = self._predict[target](body, timeout=timeout, metadata=metadata)
        reply: bytes = await call
        return prediction(pb.PredictResponse.FromString(reply), await call.trailing_metadata())

    async def health(self, *, timeout: float | None = None) -> pb.HealthResponse:
        """The first target's Health."""
        response: pb.HealthResponse = await self._stub.Health(
            pb.HealthRequest(), timeout=timeout or self.timeout
        )
        return response

    async def metadata(self, *, timeout: float | None = None) -> pb.MetadataResponse:
        response: pb.MetadataResponse = await self._stub.Metadata(
            pb.MetadataRequest(), timeout=timeout or self.timeout
        )
        return response

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
