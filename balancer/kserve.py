"""The balancer's KServe v2 face: ModelInfer routed as Predict is, on the servers' streams;
ModelReady and ModelMetadata asked of a backend that serves the model; the server calls
answered for the balancer itself; the repository calls (each server's own) UNIMPLEMENTED."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from sluice.balancer.service import INFER, BalancerService, Context
from sluice.core.errors import Code, InvalidInput
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.routing.pool import Want
from sluice.runtime import door
from sluice.runtime.process import package_version
from sluice.runtime.status import grpc_code
from sluice.shm.calls import SYSTEM_SHARED_MEMORY
from sluice.wire.body import parse

SERVICE = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MODEL_READY = f"/{SERVICE}/ModelReady"
MODEL_METADATA = f"/{SERVICE}/ModelMetadata"
NAME = "sluice-balancer"
M = TypeVar("M", bound=Message)
Handler = Callable[[bytes, Context], Awaitable[bytes]]


async def _parse(kind: type[M], body: bytes, context: Context) -> M:
    try:
        return parse(kind, body)
    except InvalidInput as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class KServeFacade:
    def __init__(self, service: BalancerService) -> None:
        self.service = service
        self.version = package_version()

    def methods(self) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
        methods: dict[str, Handler] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ServerMetadata": self.server_metadata,
            "ModelReady": self.model_ready,
            "ModelMetadata": self.model_metadata,
            INFER: self.model_infer,
        }
        handlers = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()}
        return {**handlers, **self.service.memory.kserve_methods()}

    async def model_infer(self, body: bytes, context: Context) -> bytes:
        return await self.service.unary(body, context, INFER)

    async def server_live(self, body: bytes, context: Context) -> bytes:
        await _parse(kpb.ServerLiveRequest, body, context)
        return kpb.ServerLiveResponse(live=True).SerializeToString()

    async def server_ready(self, body: bytes, context: Context) -> bytes:
        await _parse(kpb.ServerReadyRequest, body, context)
        return kpb.ServerReadyResponse(ready=self.service.pool.serving()).SerializeToString()

    async def server_metadata(self, body: bytes, context: Context) -> bytes:
        await self.service.gate(context, door.TENANT)
        await _parse(kpb.ServerMetadataRequest, body, context)
        extensions = [SYSTEM_SHARED_MEMORY] if self.service.memory.regions is not None else []
        response = kpb.ServerMetadataResponse(
            name=NAME, version=self.version, extensions=extensions
        )
        return response.SerializeToString()

    async def model_ready(self, body: bytes, context: Context) -> bytes:
        _, headers = await self.service.gate(context, door.OPEN)
        request = await _parse(kpb.ModelReadyRequest, body, context)
        want = Want(request.name, request.version)
        reply = await self.service.ask(MODEL_READY, body, want, context.time_remaining(), headers)
        if reply.code in (Code.NOT_FOUND, Code.UNAVAILABLE):
            # As Triton answers for a model it does not know.
            return kpb.ModelReadyResponse(ready=False).SerializeToString()
        if reply.code != 0:
            await context.abort(grpc_code(reply.code), reply.message)
        return reply.body

    async def model_metadata(self, body: bytes, context: Context) -> bytes:
        _, headers = await self.service.gate(context, door.TENANT)
        request = await _parse(kpb.ModelMetadataRequest, body, context)
        want = Want(request.name, request.version)
        reply = await self.service.ask(
            MODEL_METADATA, body, want, context.time_remaining(), headers
        )
        if reply.code != 0:
            await context.abort(grpc_code(reply.code), reply.message)
        return reply.body
