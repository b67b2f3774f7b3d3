"""The gRPC layer: a thin servicer that turns protobuf into core calls and core errors into
status codes. Requests arrive as raw bytes (identity deserializers) so that a body that
does not parse gets INVALID_ARGUMENT, and so a cache hit is answered from the body's digest
without parsing anything."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from server import staging
from server.batcher import BUDGET, DRAINED, FULL, Batcher
from server.cache import Entry, LRUCache, SingleFlight
from server.engine import Engine, TensorSpec
from server.errors import DeadlineExpired, InvalidInput, SluiceError
from server.stats import ServingStats
from sluice import codec
from sluice.keys import NO_CACHE_HEADER, NO_CACHE_VALUE, request_key
from sluice.v1 import inference_pb2 as pb

log = logging.getLogger("sluice.service")

SERVICE = "sluice.v1.Inference"
PREDICT = f"/{SERVICE}/Predict"
M = TypeVar("M", bound=Message)
Context = grpc.aio.ServicerContext[bytes, bytes]


@dataclass
class Call:
    """What the wrapper learned from the call's metadata, and the trailers to send back."""

    trailers: list[tuple[str, str]]
    deadline: float | None  # on the service clock
    no_cache: bool = False
    extra: dict[str, str] = field(default_factory=dict)


Handler = Callable[[bytes, Context], Awaitable[bytes]]
Method = Callable[[bytes, Call], Awaitable[bytes]]


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
        batcher: Batcher,
        cache: LRUCache,
        *,
        node_id: str,
        stats: ServingStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.batcher = batcher
        self.cache = cache
        self.flight = SingleFlight()
        self.node_id = node_id
        self.clock = clock
        self.stats = stats or ServingStats(clock=clock)
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
            no_cache = False
            for key, value in context.invocation_metadata() or ():
                if key == "x-request-id":
                    request_id = str(value)
                elif key == NO_CACHE_HEADER:
                    no_cache = value == NO_CACHE_VALUE
            remaining = context.time_remaining()
            info = Call(
                trailers=[("x-node-id", self.node_id), ("x-request-id", request_id)]
                if request_id
                else [("x-node-id", self.node_id)],
                deadline=None if remaining is None else self.clock() + remaining,
                no_cache=no_cache,
            )
            started = stats.begin()
            try:
                reply = await fn(body, info)
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
                context.set_trailing_metadata(info.trailers)
                return reply
            stats.end(started, error)
            context.set_trailing_metadata(info.trailers)
            await context.abort(code, message)

        return call

    async def predict(self, body: bytes, call: Call) -> bytes:
        if call.deadline is not None and call.deadline <= self.clock():
            raise DeadlineExpired("the deadline passed before the model could run")
        if not self.cache.enabled or call.no_cache:
            entry = await self._compute(body, call.deadline)
            call.trailers.extend(entry.trailers)
            return entry.body
        key = request_key(PREDICT, body)
        hit = self.cache.get(key)
        if hit is not None:
            entry, shared = hit, True
        else:
            entry, shared = await self._once(key, body, call.deadline)
        call.trailers.extend(entry.trailers)
        call.trailers.append(("x-cache", "hit" if shared else "miss"))
        return entry.body

    async def _once(self, key: bytes, body: bytes, deadline: float | None) -> tuple[Entry, bool]:
        """Compute under single-flight; True when another caller's computation answered.
        A shared computation that ran out of its leader's deadline is retried for a follower
        whose own deadline still allows it."""
        while True:
            joined = key in self.flight
            try:
                return await self.flight.run(key, lambda: self._store(key, body, deadline)), joined
            except DeadlineExpired:
                if not joined or (deadline is not None and deadline <= self.clock()):
                    raise

    async def _store(self, key: bytes, body: bytes, deadline: float | None) -> Entry:
        entry = await self._compute(body, deadline)
        self.cache.put(key, entry)
        return entry

    async def _compute(self, body: bytes, deadline: float | None) -> Entry:
        request = parse(pb.PredictRequest, body)
        try:
            inputs = codec.decode_all(request.inputs)
        except codec.TensorError as exc:
            raise InvalidInput(str(exc)) from None
        nonfinite = self.engine.check(inputs)
        outputs = self.engine.check_outputs(request.outputs)
        rows = staging.rows_of(inputs) if self.engine.batchable else None
        results = await self.batcher.submit(
            inputs,
            outputs,
            rows=rows or 1,
            # Requests that cannot share a batch get a group of their own.
            group=staging.group_key(inputs, outputs) if rows is not None else object(),
            deadline=deadline,
        )
        response = pb.PredictResponse(
            model=self.engine.name,
            outputs=codec.encode_all(results, typed=request.typed_outputs),
        )
        trailers = (("x-nonfinite-inputs", ",".join(nonfinite)),) if nonfinite else ()
        return Entry(response.SerializeToString(), trailers)

    async def health(self, body: bytes, call: Call) -> bytes:
        parse(pb.HealthRequest, body)
        latency = self.stats.latency()
        batcher = self.batcher.stats
        queue = self.batcher.queue
        cache = self.cache
        pool = self.engine.pool.stats()
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
            batcher=pb.BatcherStats(
                batches=batcher.batches,
                requests=batcher.requests,
                rows=batcher.rows,
                mean_batch_size=batcher.mean_batch,
                flush_full=batcher.flushes[FULL],
                flush_budget=batcher.flushes[BUDGET],
                flush_drained=batcher.flushes[DRAINED],
                queue_depth=len(queue),
                rejected=batcher.rejected,
                expired=batcher.expired,
                max_batch=queue.max_rows,
                budget_ms=queue.budget_s * 1000,
                instances=len(self.engine.instances),
                busy_instances=self.batcher.busy,
                instance_batches=[self.batcher.runs[i] for i in range(len(self.engine.instances))],
            ),
            cache=pb.CacheStats(
                enabled=cache.enabled,
                entries=len(cache),
                bytes=cache.bytes,
                hits=cache.hits,
                misses=cache.misses,
                evictions=cache.evictions,
                hit_rate=cache.hit_rate,
                shared=self.flight.joined,
                max_entries=cache.max_entries,
                max_bytes=cache.max_bytes,
            ),
            buffers=pb.BufferPoolStats(
                pinned=self.engine.pinned,
                buffers=pool.buffers,
                bytes=pool.bytes,
                reused=pool.reused,
                allocated=pool.allocated,
                dropped=pool.dropped,
            ),
        )
        return response.SerializeToString()

    async def metadata(self, body: bytes, call: Call) -> bytes:
        parse(pb.MetadataRequest, body)
        response = pb.MetadataResponse(
            model=self._model_info, platform=self.engine.platform, provider=self.engine.provider
        )
        return response.SerializeToString()
