"""The gRPC layer: a thin servicer that turns metadata and protobuf into dataplane calls and
core errors into status codes. Requests arrive as raw bytes (identity deserializers) so that
a body that does not parse gets INVALID_ARGUMENT, and so a cache hit is answered from the
body's digest without parsing anything."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc

from sluice.core.calls import BAD_REQUEST_ID, printable, stream_timeout
from sluice.core.errors import (
    Code,
    InvalidInput,
    Overloaded,
    QuotaExceeded,
    SluiceError,
    Unimplemented,
)
from sluice.core.keys import (
    NO_CACHE_HEADER,
    NO_CACHE_VALUE,
    OVERLOADED,
    REFUSED_HEADER,
    RETRY_AFTER_HEADER,
)
from sluice.core.limits import too_large
from sluice.core.stats import ServingStats, health_fields
from sluice.core.tenants import HEADER, INTERACTIVE, Account, Tenants, tenant_name
from sluice.runtime import door, spans, tracing
from sluice.runtime.door import OPEN, TENANT
from sluice.runtime.status import status_of
from sluice.server.dataplane import padding
from sluice.server.dataplane.batcher import BUDGET, DRAINED, FULL
from sluice.server.dataplane.models import Model
from sluice.server.dataplane.plane import Dataplane, WireProtocol
from sluice.server.settings import ServerSettings
from sluice.server.v1 import SluiceV1, model_info, model_statuses
from sluice.shm.calls import V1_CALLS, RegionCall, RegionCalls
from sluice.shm.registry import Regions
from sluice.v1 import inference_pb2 as pb
from sluice.wire import stream
from sluice.wire.body import parse

log = logging.getLogger("sluice.service")

SERVICE = "sluice.v1.Inference"
Context = grpc.aio.ServicerContext[bytes, bytes]
SPAN = "sluice.server/Predict"  # with tracing: one per Predict call or stream message
# Other protocols' inference calls, by method: their service and span names.
SPANS = {"ModelInfer": ("inference.GRPCInferenceService", "sluice.server/ModelInfer")}
STREAM = "PredictStream"


@dataclass
class Call:
    """What the wrapper learned from the call's metadata, and the trailers to send back."""

    trailers: list[tuple[str, str]]
    deadline: float | None  # on the dataplane's clock
    no_cache: bool = False
    refused: SluiceError | None = None  # the call's metadata is unusable: answer this
    account: Account | None = None  # the caller's tenant (auth on, a key given)
    priority: int = INTERACTIVE  # its tenant's class in the batcher
    peer: str = ""  # grpc's name for the caller, where a call needs it (a region call's)


Handler = Callable[[bytes, Context], Awaitable[bytes]]
Methods: TypeAlias = "dict[str, grpc.RpcMethodHandler[bytes, bytes]]"
Method = Callable[[bytes, Call], Awaitable[bytes]]
# The bytes of the message that carries a reply (None: a unary call's, the reply itself).
Sized = Callable[[bytes, Call], int]


class InferenceService:
    def __init__(
        self,
        plane: Dataplane,
        *,
        node_id: str,
        stats: ServingStats | None = None,
        default_timeout_s: float | None = None,
        tenants: Tenants | None = None,
        max_message_bytes: int = 0,
        regions: Regions | None = None,
    ) -> None:
        self.plane = plane
        self.regions = regions  # None: no shared memory (--shared-memory off)
        # Both faces' region calls (off: refused naming the flag).
        self.region_calls = RegionCalls(regions, ServerSettings.PROG)
        self.v1 = SluiceV1(shared_memory=regions is not None)
        # Predict: inference in sluice.v1's bodies (a partial: no frame of its own per call).
        self.predict: Method = functools.partial(self.infer, protocol=self.v1)
        # --max-message-bytes, said in Health: a balancer refuses a larger request itself
        # rather than send it on the stream it shares, which grpc here would end for it.
        self.max_message_bytes = max_message_bytes
        self.tenants = tenants  # None: auth off, every caller alike
        self.node_id = node_id
        self.default_timeout_s = default_timeout_s  # for calls that carry no deadline
        self.clock = plane.clock
        self.stats = stats or ServingStats(clock=plane.clock)
        self.serving = True
        self._draining = asyncio.Event()
        # What a PredictStream message's `method` asks for; other protocols add theirs.
        self.stream_methods: dict[str, Method] = {"": self.predict}

    def handler(self) -> grpc.GenericRpcHandler[bytes, bytes]:
        return grpc.method_handlers_generic_handler(SERVICE, self.methods())

    def methods(self) -> Methods:
        """sluice.v1.Inference's handlers by method name."""
        methods: dict[str, Method] = {
            "Predict": self.predict,
            "Health": self.health,
            "Metadata": self.metadata,
            **{name: self.region_call(fn) for name, fn in V1_CALLS.items()},
        }
        handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
            name: grpc.unary_unary_rpc_method_handler(
                self.wrap(
                    fn,
                    counted=name == "Predict",
                    access=OPEN if name == "Health" else TENANT,
                    peer=name in V1_CALLS,
                )
            )
            for name, fn in methods.items()
        }
        handlers["PredictStream"] = grpc.stream_stream_rpc_method_handler(self.predict_stream)
        return handlers

    def start_draining(self) -> None:
        """Report NOT_SERVING, refuse new stream calls (retryable elsewhere), and let each
        stream end once its calls in flight are answered."""
        self.serving = False
        self._draining.set()

    def _call(
        self,
        metadata: Iterable[tuple[str, Any]],
        remaining: float | None,
        refused: SluiceError | None = None,
        access: str = TENANT,
    ) -> Call:
        """The call's settings; a request id that cannot be echoed back (not printable
        ASCII) refuses the call before any work, and is not echoed. With auth on, so does
        a key no tenant holds, or none where `access` needs one."""
        request_id = ""
        authorization = None
        no_cache = False
        for key, value in metadata:
            if key == "x-request-id":
                request_id = value if isinstance(value, str) else value.decode("latin-1")
            elif key == NO_CACHE_HEADER:
                no_cache = value == NO_CACHE_VALUE
            elif key == HEADER:
                authorization = value if isinstance(value, str) else value.decode("latin-1")
        trailers = [("x-node-id", self.node_id)]
        if request_id and not printable(request_id):
            refused = refused or InvalidInput(BAD_REQUEST_ID)
        elif request_id:
            trailers.append(("x-request-id", request_id))
        if remaining is None:
            remaining = self.default_timeout_s
        call = Call(
            trailers=trailers,
            deadline=None if remaining is None else self.clock() + remaining,
            no_cache=no_cache,
            refused=refused,
        )
        if self.tenants is not None:
            try:
                call.account = door.caller(self.tenants, authorization, access)
            except SluiceError as exc:
                call.refused = call.refused or exc
            if call.account is not None:
                call.priority = call.account.tenant.priority
        return call

    def _served(
        self, metadata: Mapping[str, str] | Iterable[tuple[str, Any]], method: str, info: Call
    ) -> spans.Served | None:
        """With tracing on, the call's SERVER span, the child of the caller's span that
        `metadata` names (None when not sampled): node id, stream, request id; `_invoke` adds
        the status and an admission refusal's event, the dataplane the cache's part
        (`sluice.cache`) and the model run's span."""
        service, name = SPANS.get(method, (SERVICE, SPAN))
        # The request id as echoed: one that is not printable ASCII is not.
        request_id = next((v for k, v in info.trailers if k == "x-request-id"), None)
        return spans.served(
            name,
            metadata,
            method,
            service,
            node_id=self.node_id,
            stream=method == STREAM,
            request_id=request_id,
        )

    async def _invoke(
        self,
        fn: Method,
        body: bytes,
        info: Call,
        stats: ServingStats,
        served: spans.Served | None,
        sized: Sized | None = None,
    ) -> bytes | tuple[grpc.StatusCode, str]:
        """The reply, or the status and message of the failure, counted in `stats` (and in
        the caller's tenant's account, with auth on), and told to `served` (tracing). A
        reply whose message (`sized`) is over --max-message-bytes is RESOURCE_EXHAUSTED."""
        started = stats.begin()
        tenants = self.tenants if stats is self.stats else None  # inference calls only
        account = info.account if tenants is not None else None
        entered = False
        status: str | None = None
        reason = ""
        outcome: bytes | tuple[grpc.StatusCode, str]
        try:
            if info.refused is not None:
                raise info.refused
            if tenants is not None and account is not None:  # the tenant's quota and share
                tenants.enter(account)
                entered = True
            outcome = await fn(body, info)
            limit = self.max_message_bytes
            size = len(outcome) if sized is None or not limit else sized(outcome, info)
            if limit and size > limit:
                status = "RESOURCE_EXHAUSTED"
                # Not sent: grpc would fail a unary call with its own words, and end a
                # stream, every call on it with it, for one such reply.
                outcome = (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    too_large("reply", size, f"server {self.node_id}", limit),
                )
        except SluiceError as exc:
            status, reason = exc.status, exc.reason
            if isinstance(exc, Overloaded):  # refused before any work: another may take it
                info.trailers.append((REFUSED_HEADER, OVERLOADED))
            elif isinstance(exc, QuotaExceeded) and exc.retry_after_s:
                info.trailers.append((RETRY_AFTER_HEADER, str(math.ceil(exc.retry_after_s * 1000))))
            outcome = status_of(exc), str(exc)
        except asyncio.CancelledError as exc:
            status = "CANCELLED"
            stats.end(started, status)
            if served is not None:
                served.failed(exc)
            raise
        except Exception:
            log.exception("unexpected failure")
            status = "INTERNAL"
            outcome = grpc.StatusCode.INTERNAL, "internal error"
        finally:
            if account is not None:
                Tenants.settle(account, entered, status, reason)
        stats.end(started, status, reason)
        if served is not None:
            _told(served, info, outcome)
        return outcome

    def wrap(
        self,
        fn: Method,
        *,
        counted: bool,
        method: str = "Predict",
        access: str = TENANT,
        peer: bool = False,
    ) -> Handler:
        """A unary handler for `fn`, any protocol's: request id, node id, error mapping;
        `counted` calls (inference) go into the serving stats, pass their tenant's quota
        (auth on) and, with tracing, a span named for `method`. `access`: who may call
        with auth on (OPEN, TENANT, ADMIN). `peer`: `fn` is told who calls (Call.peer)."""
        stats = self.stats if counted else ServingStats(window=1)

        async def call(body: bytes, context: Context) -> bytes:
            metadata = context.invocation_metadata() or ()
            info = self._call(metadata, context.time_remaining(), access=access)
            if peer:
                info.peer = context.peer()
            served = self._served(metadata, method, info) if counted and tracing.ON else None
            outcome = await self._invoke(fn, body, info, stats, served)
            # grpc keeps an aborted call's exception, whose traceback holds this frame: drop
            # the body now, or a refused 25 MB request stays until the next call arrives.
            del body
            context.set_trailing_metadata(info.trailers)
            if isinstance(outcome, bytes):
                return outcome
            await context.abort(*outcome)

        return call

    async def predict_stream(self, requests: AsyncIterator[bytes], context: Context) -> None:
        """Predict calls multiplexed on one stream; while draining, new ones are refused as
        retryable and the stream ends once the calls already read are answered."""
        # A message without its own key is the stream's caller's (a balancer's messages
        # each carry their caller's).
        stream_key = next((v for k, v in context.invocation_metadata() or () if k == HEADER), None)

        async def answer(message: stream.Request) -> bytes:
            refused: SluiceError | None = None
            try:
                timeout = stream_timeout(message.timeout_s)
            except InvalidInput as exc:
                timeout, refused = None, exc
            fn = self.stream_methods.get(message.method)
            if fn is None:
                fn = self.predict
                refused = refused or Unimplemented(
                    f"PredictStream carries no method {message.method!r}; it carries "
                    + ", ".join(repr(m or "Predict") for m in self.stream_methods)
                )
            metadata: Iterable[tuple[str, Any]] = message.metadata.items()
            if stream_key is not None and HEADER not in message.metadata:
                metadata = [*metadata, (HEADER, stream_key)]
            info = self._call(metadata, timeout, refused)
            served = self._served(message.metadata, STREAM, info) if tracing.ON else None

            def sized(response: bytes, call: Call) -> int:  # in its StreamResponse
                limit = self.max_message_bytes
                return stream.response_size(limit, message.id, response, call.trailers)

            outcome = await self._invoke(fn, message.request, info, self.stats, served, sized)
            if isinstance(outcome, bytes):
                return stream.write_response(message.id, outcome, trailers=info.trailers)
            return stream.write_response(
                message.id,
                code=outcome[0].value[0],
                message=outcome[1],
                trailers=info.trailers,
                retryable=any(key == REFUSED_HEADER for key, _ in info.trailers),
            )

        def refuse(message: stream.Request) -> bytes | None:
            if not self._draining.is_set():
                return None
            return stream.write_response(
                message.id,
                code=Code.UNAVAILABLE,
                message=f"node {self.node_id} is draining",
                retryable=True,
            )

        await stream.serve(requests, context.write, answer, refuse=refuse, stop=self._draining)

    def region_call(self, fn: RegionCall) -> Method:
        """A shared memory region call of either face, on its caller's tenant's regions."""

        async def method(body: bytes, call: Call) -> bytes:
            return self.region_calls.call(fn, tenant_name(call.account), call.peer, body)

        return method

    async def infer(self, body: bytes, call: Call, protocol: WireProtocol[Any]) -> bytes:
        """One inference call of any protocol, its trailers added to `call`; with shared
        memory on, it holds a lease on its caller's regions until it is answered."""
        leases = (
            None
            if self.regions is None
            else functools.partial(self.regions.lease, tenant_name(call.account))
        )
        entry, cached = await self.plane.infer(
            body,
            protocol,
            deadline=call.deadline,
            cache=not call.no_cache,
            priority=call.priority,
            lease=leases,
        )
        if entry.nonfinite:
            call.trailers.append(("x-nonfinite-inputs", ",".join(entry.nonfinite)))
        if cached is not None:
            call.trailers.append(("x-cache", cached))
        return entry.body

    async def health(self, body: bytes, call: Call) -> bytes:
        request = parse(pb.HealthRequest, body)
        models = self.plane.models
        if request.model:  # that model's health: NOT_FOUND unless it is served
            model: Model | None = models.get(request.model)
            listed = [s for s in model_statuses(models) if s.name == request.model]
        else:
            model = models.default or next(iter(models), None)
            listed = model_statuses(models)
        response = pb.HealthResponse(
            role="server",
            node_id=self.node_id,
            status="SERVING" if self.serving and len(models) else "NOT_SERVING",
            **health_fields(self.stats),
            models=listed,
            max_message_bytes=self.max_message_bytes,
            cache=pb.CacheStats(
                enabled=self.plane.cache.enabled,
                entries=len(self.plane.cache),
                bytes=self.plane.cache.bytes,
                hits=self.plane.cache.hits,
                misses=self.plane.cache.misses,
                evictions=self.plane.cache.evictions,
                hit_rate=self.plane.cache.hit_rate,
                shared=self.plane.flight.joined,
                max_entries=self.plane.cache.max_entries,
                max_bytes=self.plane.cache.max_bytes,
            ),
        )
        if self.tenants is not None:
            response.tenants.extend(door.statuses(self.tenants, call.account))
        if model is not None:  # the named (or default) model's own figures
            response.model.CopyFrom(model_info(model))
            response.provider = model.engine.provider
            response.fallback = model.engine.fallback
            response.batcher.CopyFrom(_batcher_stats(model))
            response.buffers.CopyFrom(_buffer_stats(model))
        return response.SerializeToString()

    async def metadata(self, body: bytes, call: Call) -> bytes:
        request = parse(pb.MetadataRequest, body)
        model = self.plane.models.get(request.model, request.version)
        response = pb.MetadataResponse(
            model=model_info(model),
            platform=model.engine.platform,
            provider=model.engine.provider,
            models=model_statuses(self.plane.models),
        )
        return response.SerializeToString()


def _told(served: spans.Served, info: Call, outcome: bytes | tuple[grpc.StatusCode, str]) -> None:
    """The call's end on its span: the status, and an event for a refusal at the door."""
    if isinstance(outcome, bytes):
        served.end(0)
        return
    code, message = outcome[0].value[0], outcome[1]
    refused = dict(info.trailers).get(REFUSED_HEADER)
    if refused is not None:  # refused at the door, before any work
        served.event("sluice.admission.refused", {"reason": refused, "message": message})
    served.end(code, message)


def _batcher_stats(model: Model) -> pb.BatcherStats:
    scheduler, engine = model.batcher, model.engine
    batcher, queue = scheduler.stats, scheduler.queue
    return pb.BatcherStats(
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
        instances=len(engine.instances),
        busy_instances=scheduler.busy,
        instance_batches=[scheduler.runs[i] for i in range(len(engine.instances))],
        real_tokens=batcher.real_tokens,
        padded_tokens=batcher.padded_tokens,
        padding_efficiency=batcher.padding_efficiency,
        buckets=model.padding.buckets.listed() if model.padding is not None else (),
        max_length=model.padding.buckets.limit if model.padding is not None else 0,
        bucket_batches={str(padding.label(b)): n for b, n in batcher.by_bucket.items()},
    )


def _buffer_stats(model: Model) -> pb.BufferPoolStats:
    engine = model.engine
    pool = engine.pool.stats()
    return pb.BufferPoolStats(
        pinned=engine.pinned,
        buffers=pool.buffers,
        bytes=pool.bytes,
        reused=pool.reused,
        allocated=pool.allocated,
        dropped=pool.dropped,
    )
