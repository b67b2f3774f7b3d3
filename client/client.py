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

from sluice import codec
from sluice.keys import NO_CACHE_HEADER, NO_CACHE_VALUE
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc

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


class SluiceClient:
    """Blocking client for one target (a server or a balancer)."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: ChannelOptions = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            target, options=channel_options(max_message_bytes, options)
        )
        self._stub = pb_grpc.InferenceStub(self._channel)

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
        response, call = self._stub.Predict.with_call(
            predict_request(inputs, outputs),
            timeout=timeout or self.timeout,
            metadata=call_metadata(request_id, no_cache),
        )
        return prediction(response, call.trailing_metadata())

    def health(self, *, timeout: float | None = None) -> pb.HealthResponse:
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
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncSluiceClient:
    """asyncio client for one target; create and use it inside a running event loop."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: ChannelOptions = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(
            target, options=channel_options(max_message_bytes, options)
        )
        self._stub = pb_grpc.InferenceStub(self._channel)

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
        call = self._stub.Predict(
            predict_request(inputs, outputs),
            timeout=timeout or self.timeout,
            metadata=call_metadata(request_id, no_cache),
        )
        response = await call
        return prediction(response, await call.trailing_metadata())

    async def health(self, *, timeout: float | None = None) -> pb.HealthResponse:
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
        await self._channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
