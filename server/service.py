"""The gRPC layer: a thin servicer that turns protobuf into core calls and core errors into
status codes. Requests arrive as raw bytes (identity deserializers) so that a body that
does not parse gets INVALID_ARGUMENT, and so the body itself can later key a cache."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from server.engine import Engine, TensorSpec
from server.errors import DeadlineExpired, InvalidInput, SluiceError
from server.stats import ServingStats
from sluice import codec
from sluice.v1 import inference_pb2 as pb

log = logging.getLogger("sluice.service")

SERVICE = "sluice.v1.Inference"
M = TypeVar("M", bound=Message)
Context = grpc.aio.ServicerContext[bytes, bytes]
Trailers = list[tuple[str, str]]
Handler = Callable[[bytes, Context], Awaitable[bytes]]
# A method gets the raw body, the call's context and the trailers it may add to.
Method = Callable[[bytes, Context, Trailers], Awaitable[bytes]]


def status_of(error: SluiceError) -> grpc.StatusCode:
    """The one table from core errors to gRPC status codes: each error names its status."""
    return grpc.StatusCode[error.status]


def parse(kind: type[M], body: bytes) -> M:
    try:
        return kind.FromString(body)
    except DecodeError as exc:
        raise InvalidInput(
            f"request body is not a valid {kind.DESCRIPTOR.full_name} message: {exc}"
        ) from None


def spec_messages(specs: list[TensorSpec]) -> list[pb.TensorSpec]:
    return [
        pb.TensorSpec(
            name=s.name, datatype=s.datatype, shape=[-1 if d is None else d for d in s.shape]
        )
        for s in specs
    ]


class InferenceService:
    def __init__(
        self,
        engine: Engine,
        executor: Executor,
        *,
        node_id: str,
        stats: ServingStats | None = None,
    ) -> None:
        self.engine = engine
        self.executor = executor
        self.node_id = node_id
        self.stats = stats or ServingStats()
        self.serving = True
        self._model_info = pb.ModelInfo(
            name=engine.name,
            inputs=spec_messages(engine.inputs),
            outputs=spec_messages(engine.outputs),
        )

    def handler(self) -> grpc.GenericRpcHandler[bytes, bytes]:
        methods: dict[str, Method] = {
            "Predict": self.predict,
            "Health": self.health,
            "Metadata": self.metadata,
        }
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                name: grpc.unary_unary_rpc_method_handler(self._wrap(fn, counted=name == "Predict"))
                for name, fn in methods.items()
            },
        )

    def _wrap(self, fn: Method, *, counted: bool) -> Handler:
        """Request id, node id, error mapping; `counted` calls go into the serving stats."""
        stats = self.stats if counted else ServingStats(window=1)

        async def call(body: bytes, context: Context) -> bytes:
            request_id = ""
            for key, value in context.invocation_metadata() or ():
                if key == "x-request-id":
                    request_id = str(value)
            trailers = [
                ("x-node-id", self.node_id),
                ("x-request-id", request_id or os.urandom(8).hex()),
            ]
            started = stats.begin()
            try:
                reply = await fn(body, context, trailers)
            except SluiceError as exc:
                error, code, message = exc.status, status_of(exc), str(exc)
            except asyncio.CancelledError:
                stats.end(started, "CANCELLED")
                raise
            except Exception:
                log.exception("unexpected failure")
                error, code, message = "INTERNAL", grpc.StatusCode.INTERNAL, "internal error"
            else:
                stats.end(started)
                context.set_trailing_metadata(trailers)
                return reply
            stats.end(started, error)
            context.set_trailing_metadata(trailers)
            await context.abort(code, message)

        return call

    async def predict(self, body: bytes, context: Context, trailers: Trailers) -> bytes:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExpired("the deadline passed before the model could run")
        request = parse(pb.PredictRequest, body)
        try:
            inputs = codec.decode_all(request.inputs)
        except codec.TensorError as exc:
            raise InvalidInput(str(exc)) from None
        nonfinite = self.engine.check(inputs)
        outputs = self.engine.check_outputs(request.outputs)
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self.executor, self.engine.run, inputs, outputs)
        if nonfinite:
            trailers.append(("x-nonfinite-inputs", ",".join(nonfinite)))
        response = pb.PredictResponse(
            model=self.engine.name,
            outputs=codec.encode_all(results, typed=request.typed_outputs),
        )
        return response.SerializeToString()

    async def health(self, body: bytes, context: Context, trailers: Trailers) -> bytes:
        parse(pb.HealthRequest, body)
        latency = self.stats.latency()
        response = pb.HealthResponse(
            node_id=self.node_id,
            status="SERVING" if self.serving else "NOT_SERVING",
            model=self._model_info,
            provider=self.engine.provider,
            uptime_s=self.stats.uptime_s,
            requests=self.stats.requests,
            errors=sum(self.stats.errors.values()),
            errors_by_code=dict(self.stats.errors),
            latency=pb.LatencySummary(
                count=latency.count,
                p50_ms=latency.p50_ms,
                p90_ms=latency.p90_ms,
                p99_ms=latency.p99_ms,
                max_ms=latency.max_ms,
            ),
            in_flight=self.stats.in_flight,
        )
        return response.SerializeToString()

    async def metadata(self, body: bytes, context: Context, trailers: Trailers) -> bytes:
        parse(pb.MetadataRequest, body)
        response = pb.MetadataResponse(
            model=self._model_info, platform=self.engine.platform, provider=self.engine.provider
        )
        return response.SerializeToString()
