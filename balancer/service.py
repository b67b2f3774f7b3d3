"""The balancer's gRPC face: the same sluice.v1.Inference API as a server, forwarding raw
bytes (the body is not parsed: its model and version are read off the wire, sluice.wire.facts;
only a Predict that fan-out splits, `--fanout-rows`, is, in sluice.balancer.fanout) to the
backend the pool chooses among those that serve the model. The attempt loop (retries within a
retry budget and the caller's deadline, what counts against a backend) is the shared call
planner, sluice.routing.planner, called from one place (`_call`); tracing hangs on it as
observers (sluice.runtime.spans). KServe v2 ModelInfer bodies take the same way
(`forward(..., method=INFER)`; the facade is sluice.balancer.kserve). A body whose tensors
lie in its caller's regions is relayed by sluice.shm.balancer."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping

import grpc
from google.protobuf.message import DecodeError

from sluice.balancer import fanout
from sluice.balancer.upstream import Upstream
from sluice.core.calls import check_request_id, stream_timeout
from sluice.core.errors import (
    Code,
    InvalidInput,
    QuotaExceeded,
    SluiceError,
    reason_of,
    status_name,
)
from sluice.core.keys import (
    NO_CACHE_HEADER,
    OVERLOADED,
    REFUSED_HEADER,
    RETRY_AFTER_HEADER,
    affinity_key,
)
from sluice.core.limits import too_large
from sluice.core.stats import ServingStats, health_fields
from sluice.core.tenants import HEADER, Account, Tenants, tenant_name
from sluice.core.version_order import version_key
from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import HedgeSettings, Hedging, report
from sluice.routing.plan import Observer, rule_of
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Pool, Want
from sluice.runtime import door, spans, tracing
from sluice.runtime.status import grpc_code
from sluice.shm.balancer import Relay, SharedMemory
from sluice.shm.registry import Regions
from sluice.v1 import inference_pb2 as pb
from sluice.wire import facts, peek, stream
from sluice.wire.mux import Reply, StreamBroken

log = logging.getLogger("sluice.balancer")

SERVICE = "sluice.v1.Inference"
METADATA = f"/{SERVICE}/Metadata"
INFER = "ModelInfer"  # StreamRequest.method of a KServe v2 ModelInferRequest body
# The message each method's bodies are ("": Predict).
KINDS = {"": facts.PREDICT, INFER: facts.MODEL_INFER}
# Trace context passes through as it came; with tracing on, each attempt's replaces it.
# The caller's API key goes on too: a server with the tenants file checks it again.
FORWARDED = ("x-request-id", NO_CACHE_HEADER, HEADER, *tracing.HEADERS)
SPAN = "sluice.balancer/Predict"  # with tracing: one SERVER span per call ...
SPANS = {INFER: ("sluice.balancer/ModelInfer", "inference.GRPCInferenceService")}
ATTEMPT = "sluice.balancer/attempt"  # ... and a CLIENT span per attempt
CHUNK = "sluice.balancer/chunk"  # a fanned-out call: a CLIENT span per chunk instead
FANOUT_CHUNKS = "sluice.fanout.chunks"  # the call's, on its SERVER span
FANOUT_CHUNK = "sluice.fanout.chunk"  # which one, from 1
FANOUT_ROWS = "sluice.fanout.rows"  # its rows of the request's, "first-last"
NO_METADATA: Mapping[str, str] = {}
Context = grpc.aio.ServicerContext[bytes, bytes]
# The bytes of the message that would carry a reply to the caller (0: far under the limit).
Sized = Callable[[Reply], int]


def unary_size(reply: Reply) -> int:
    return len(reply.body)  # a unary call's message is the reply itself


class ChunkFailed(Exception):
    """A fan-out chunk's answer was a failure: its siblings are cancelled."""


def send(
    backend: Backend, body: bytes, headers: Mapping[str, str], left: float | None, method: str
) -> Awaitable[Reply]:
    """One attempt over `backend`'s multiplexed streams (the transport is an Upstream)."""
    transport: Upstream = backend.transport
    return transport.predict(body, headers, left, method)


def refusal(metadata: Mapping[str, str], timeout_s: float = 0.0) -> str | None:
    """Why a Predict is refused (INVALID_ARGUMENT) before it is forwarded, as the server
    would refuse it (sluice.core.calls)."""
    try:
        check_request_id(metadata.get("x-request-id", ""))
        stream_timeout(timeout_s)
    except InvalidInput as exc:
        return str(exc)
    return None


class BalancerService:
    def __init__(
        self,
        pool: Pool,
        budget: RetryBudget,
        *,
        node_id: str,
        clock: Callable[[], float] = time.monotonic,
        default_timeout_s: float | None = None,
        fanout_rows: int = 0,
        tenants: Tenants | None = None,
        max_message_bytes: int = 0,
        regions: Regions | None = None,
        hedge: HedgeSettings | None = None,
    ) -> None:
        self.tenants = tenants  # None: auth off
        self.memory = SharedMemory(regions, self.gate)
        # The largest reply its listener sends (--max-message-bytes; 0: none): a larger one
        # is answered RESOURCE_EXHAUSTED for its call alone, where grpc would end a stream,
        # and every call on it, for it, and fail a unary call in its own words.
        self.max_message_bytes = max_message_bytes
        self.pool = pool
        self.fanout_rows = fanout_rows  # a Predict with more rows is split (0: never)
        self.fanned = fanout.FanoutStats()
        self.budget = budget
        self.node_id = node_id
        self.default_timeout_s = default_timeout_s  # for calls that carry no deadline
        self.clock = clock
        self.stats = ServingStats(clock=clock)
        # A stream that broke before the reply fails its calls with StreamBroken.
        self.planner = Planner(
            pool,
            budget,
            Reply,
            broken=(StreamBroken,),
            clock=clock,
            hedging=Hedging.of(hedge, clock),
        )

    def methods(self) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
        """sluice.v1.Inference's handlers by method name."""
        return {
            "Predict": grpc.unary_unary_rpc_method_handler(self.predict),
            "PredictStream": grpc.stream_stream_rpc_method_handler(self.predict_stream),
            "Health": grpc.unary_unary_rpc_method_handler(self.health),
            "Metadata": grpc.unary_unary_rpc_method_handler(self.metadata),
            **self.memory.v1_methods(),
        }

    def _deadline(self, remaining: float | None) -> float | None:
        """The call's deadline on our clock; `default_timeout_s` for a call that has none."""
        if remaining is None:
            remaining = self.default_timeout_s
        return None if remaining is None else self.clock() + remaining

    async def predict(self, body: bytes, context: Context) -> bytes:
        return await self.unary(body, context)

    async def unary(self, body: bytes, context: Context, method: str = "") -> bytes:
        """A unary call forwarded over the streams: Predict, or `method` (INFER)."""
        metadata = {
            k: v if isinstance(v, str) else v.decode("latin-1")
            for k, v in context.invocation_metadata() or ()
        }
        refused = refusal(metadata)
        if refused is not None:
            self._refused()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        deadline = self._deadline(context.time_remaining())
        reply = await self.forward(body, metadata, deadline, method=method, sized=unary_size)
        trailers = reply.trailers
        if reply.retryable and REFUSED_HEADER not in trailers:  # refused here, not upstream
            trailers = {**trailers, REFUSED_HEADER: OVERLOADED}
        context.set_trailing_metadata(tuple(trailers.items()))
        if reply.code == 0:
            return reply.body
        await context.abort(grpc_code(reply.code), reply.message)

    async def predict_stream(self, requests: AsyncIterator[bytes], context: Context) -> None:
        """Clients may multiplex too: each message is forwarded on its own, a Predict or
        what its `method` names, as a server's streams carry them."""

        # A message without its own key is the stream's caller's.
        stream_key = next(
            (str(v) for k, v in context.invocation_metadata() or () if k == HEADER), None
        )

        async def answer(message: stream.Request) -> bytes:
            metadata, timeout, method = message.metadata, message.timeout_s, message.method
            if stream_key is not None and HEADER not in metadata:
                metadata[HEADER] = stream_key
            refused = refusal(metadata, timeout)
            if method not in KINDS:
                refused = f"PredictStream carries no method {method!r}; it carries " + ", ".join(
                    repr(m or "Predict") for m in KINDS
                )
            if refused is not None:
                self._refused()
                return stream.write_response(
                    message.id, code=Code.INVALID_ARGUMENT, message=refused
                )
            deadline = self._deadline(stream_timeout(timeout))

            def sized(reply: Reply) -> int:  # in its StreamResponse
                trailers = reply.trailers.items()
                return stream.response_size(
                    self.max_message_bytes, message.id, reply.body, trailers
                )

            reply = await self.forward(
                message.request, metadata, deadline, stream=True, method=method, sized=sized
            )
            return stream.write_response(
                message.id,
                reply.body,
                reply.code,
                reply.message,
                reply.trailers.items(),
                reply.retryable,
            )

        await stream.serve(requests, context.write, answer)

    def _refused(self) -> None:
        """Count a call refused before any forwarding."""
        self.stats.end(self.stats.begin(), "INVALID_ARGUMENT")

    async def forward(
        self,
        body: bytes,
        metadata: Mapping[str, str],
        deadline: float | None,
        *,
        stream: bool = False,
        method: str = "",
        sized: Sized | None = None,
    ) -> Reply:
        """One Predict (or, `method` INFER, one KServe v2 ModelInfer) through the planner,
        among the backends that serve the model the body names: each attempt goes over the
        chosen backend's multiplexed streams with the time left. `stream`: it came on a
        PredictStream. A Predict with more rows than `fanout_rows` (when set) goes as
        chunks to several backends at once (sluice.balancer.fanout). `sized`: the bytes of
        the message that would carry a reply to the caller (None: not checked), so one over
        --max-message-bytes is RESOURCE_EXHAUSTED."""
        started = self.stats.begin()
        account = None
        if self.tenants is not None:  # the caller's key, its tenant's share and quota
            try:
                account = self.tenants.authenticate(metadata.get(HEADER))
                self.tenants.enter(account)
            except SluiceError as exc:
                return self._turned_away(started, account, exc)
        tenant = tenant_name(account)
        try:
            reply = await self._placed(
                started, body, metadata, deadline, stream, method, sized, tenant
            )
        except BaseException:
            if account is not None:
                Tenants.settle(account, True, "CANCELLED", "")
            raise
        if account is not None:
            status = None if reply.code == 0 else status_name(reply.code)
            Tenants.settle(account, True, status, reason_of(reply.code, reply.message))
        return reply

    def _turned_away(self, started: float, account: Account | None, exc: SluiceError) -> Reply:
        """A call refused at the door: counted, with its reason, and answered."""
        if account is not None:
            Tenants.settle(account, False, exc.status, exc.reason)
        self.stats.end(started, exc.status, exc.reason)
        trailers = {}
        if isinstance(exc, QuotaExceeded) and exc.retry_after_s:
            trailers[RETRY_AFTER_HEADER] = str(math.ceil(exc.retry_after_s * 1000))
        return Reply(Code[exc.status], str(exc), trailers=trailers)

    async def _placed(
        self,
        started: float,
        body: bytes,
        metadata: Mapping[str, str],
        deadline: float | None,
        stream: bool,
        method: str,
        sized: Sized | None,
        tenant: str,
    ) -> Reply:
        """`forward` past the door, the body as sluice.shm.balancer's `prepare` makes it
        (`placing`, None for a body as it came), its lease held until the call ends."""
        try:
            placing = self.memory.prepare(body, KINDS[method], tenant)
        except SluiceError as exc:  # as the server would refuse it
            self.stats.end(started, exc.status, exc.reason)
            return Reply(Code[exc.status], str(exc))
        if placing is None:
            return await self._forward(started, body, metadata, deadline, stream, method, sized)
        try:
            return await self._forward(
                started, placing.body, metadata, deadline, stream, method, sized, placing
            )
        finally:  # one that ended without an answer (cancelled) writes nothing back
            placing.release(ok=False)

    async def _forward(
        self,
        started: float,
        body: bytes,
        metadata: Mapping[str, str],
        deadline: float | None,
        stream: bool,
        method: str,
        sized: Sized | None,
        placing: Relay | None = None,
    ) -> Reply:
        """`forward` past the door and `prepare` (`placing`: the call's, whose outputs are
        written from the answer returned, once, whatever the attempts)."""
        forwarded = {k: metadata[k] for k in FORWARDED if k in metadata}
        kind = KINDS[method]
        # One read of the body: its model, its id (out of the affinity key, so identical
        # inputs meet on one server whatever ids callers give them, as the server's cache
        # keys leave it out too) and, for fan-out, its rows. Only Predict bodies fan out: a
        # KServe ModelInfer goes whole (out of fan-out's scope).
        try:
            read = facts.read(body, kind, rows=bool(self.fanout_rows) and kind is facts.PREDICT)
        except peek.Malformed as exc:  # as the server would refuse it
            self.stats.end(started, "INVALID_ARGUMENT")
            return Reply(Code.INVALID_ARGUMENT, str(exc))
        want = Want(read.model, read.version)
        parts = None if read.rows is None else fanout.split(body, self.fanout_rows, read)
        traced = None
        chunks = 0 if parts is None else len(parts.bodies)  # 0 once the call goes whole
        try:  # the span's making too: a failure there must not leave the call in flight
            if tracing.ON:
                traced = self._served(metadata, forwarded, stream, method)
            reply = None
            if parts is not None:
                reply = await self._fan_out(parts, forwarded, deadline, want, traced)
            if reply is None:  # whole: not split, or its outputs are not per row
                chunks = 0
                key = affinity_key(body, metadata, read.id_span)
                observer = None
                if traced is not None:
                    observer = spans.Attempts(
                        ATTEMPT, traced.span, forwarded, lambda b: self._routing(key, want, b)
                    )
                reply = await self._call(body, key, deadline, want, forwarded, method, observer)
        except BaseException as exc:  # cancelled by its caller: it is not in flight any more
            if traced is not None:
                if chunks:  # its chunks were out
                    traced.span.set_attribute(FANOUT_CHUNKS, chunks)
                traced.failed(exc)
            self.stats.end(started, "CANCELLED")
            raise
        if placing is not None:
            reply = placing.finish(reply)
        if sized is not None and reply.code == 0:
            reply = self._capped(reply, sized(reply))
        code = reply.code
        if traced is not None:
            if chunks:  # the split answered; a call that went whole counts none
                traced.span.set_attribute(FANOUT_CHUNKS, chunks)
            traced.end(code, reply.message)
        self.stats.end(
            started, None if code == 0 else status_name(code), reason_of(code, reply.message)
        )
        return reply

    def _capped(self, reply: Reply, size: int) -> Reply:
        """`reply`, or RESOURCE_EXHAUSTED naming this balancer's limit when the message that
        carries it (`size` bytes) is over it."""
        if not self.max_message_bytes or size <= self.max_message_bytes:
            return reply
        why = too_large("reply", size, f"balancer {self.node_id}", self.max_message_bytes)
        return Reply(Code.RESOURCE_EXHAUSTED, why, trailers=reply.trailers)

    def _call(
        self,
        body: bytes,
        key: int | None,
        deadline: float | None,
        want: Want,
        headers: dict[str, str],
        method: str,
        observer: Observer[Reply] | None,
    ) -> Awaitable[Reply]:
        """The one way a call goes through the planner: each attempt sends `body` and
        `headers` over the chosen backend's streams with the time left. `observer` (tracing)
        is told of each attempt, and may put its trace context into `headers` first."""
        return self.planner.run(
            key,
            deadline,
            lambda backend, left: send(backend, body, headers, left, method),
            want,
            observer,
        )

    def _served(
        self,
        metadata: Mapping[str, str],
        forwarded: dict[str, str],
        stream: bool,
        method: str,
    ) -> spans.Served | None:
        """With tracing on, the call's SERVER span, the child of the caller's span that
        `metadata` names; None when the call is not sampled (its context goes on in
        `forwarded`, in place of the caller's). Each attempt is a CLIENT span of its own, or,
        fanned out, each chunk (`sluice.fanout.chunks`, set at its end). `sluice.stream`
        marks a Predict that came on a PredictStream: another method is named for itself."""
        name, service = SPANS.get(method, (SPAN, SERVICE))
        return spans.served(
            name,
            metadata,
            method or ("PredictStream" if stream else "Predict"),
            service,
            node_id=self.node_id,
            stream=stream and not method,
            request_id=metadata.get("x-request-id"),
            headers=forwarded,
        )

    async def _fan_out(
        self,
        parts: fanout.Split,
        forwarded: dict[str, str],
        deadline: float | None,
        want: Want,
        traced: spans.Served | None,
    ) -> Reply | None:
        """The chunks of a split Predict in parallel, each a call of its own through the
        planner (its own retries, the call's deadline), spread over the backends (`Pool.spread`);
        their answers merged in order. The first chunk to fail fails the call with its
        status, and the others are cancelled. None when the model's outputs do not follow
        the rows: the request must go whole. `traced`: the call's span (tracing on)."""
        self.fanned.calls += 1
        self.fanned.chunks += len(parts.bodies)
        keys = self.pool.spread(want, len(parts.bodies))
        failed: list[tuple[int, Reply]] = []

        async def chunk(index: int) -> Reply:
            headers, observer = forwarded, None
            if traced is not None:  # a CLIENT span per chunk, its context for each attempt
                start, stop = parts.bounds[index]
                attributes: tracing.Attributes = {
                    FANOUT_CHUNK: index + 1,
                    FANOUT_ROWS: f"{start}-{stop - 1}",
                }
                headers = dict(forwarded)
                observer = spans.Sending(CHUNK, traced.span, attributes, headers)
            body = parts.bodies[index]
            reply = await self._call(body, keys[index], deadline, want, headers, "", observer)
            if reply.code != 0:
                failed.append((index, reply))
                raise ChunkFailed  # the group cancels the other chunks
            return reply

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(chunk(i)) for i in range(len(parts.bodies))]
        except* ChunkFailed:
            pass  # the first in `failed` is the answer
        if failed:
            index, reply = failed[0]
            return Reply(
                reply.code,
                f"{parts.where(index)}: {reply.message}",
                trailers=reply.trailers,
                retryable=reply.retryable,
            )
        replies = [task.result() for task in tasks]
        trailers = fanout.merge_trailers([r.trailers for r in replies])
        try:
            return Reply(0, body=fanout.merge([r.body for r in replies], parts), trailers=trailers)
        except fanout.NotRowWise as exc:
            log.debug("the request goes whole: %s", exc)
            return None
        except fanout.MergeError as exc:
            return Reply(exc.code, str(exc), trailers=trailers)

    def _routing(self, key: int | None, want: Want, backend: Backend) -> tuple[str, str]:
        """How the pool chose `backend` for a call with affinity `key`, and why."""
        if key is None:
            return "least-loaded", (
                "the call skips the cache: two random choices by in-flight x EWMA latency"
            )
        owner = self.pool.route(want).ring.owner(key)
        if owner == backend.address:
            return "affinity", "the key's owner on the ring"
        return "affinity", f"the key's owner {owner} was tried, is out or is over its load bound"

    async def gate(self, context: Context, access: str) -> tuple[Account | None, dict[str, str]]:
        """A control call's caller (auth on) and the metadata to forward with it (its key);
        a caller that may not make it is answered here."""
        if self.tenants is None:
            return None, {}
        key = next((str(v) for k, v in context.invocation_metadata() or () if k == HEADER), None)
        try:
            account = door.caller(self.tenants, key, access)
        except SluiceError as exc:
            self.stats.end(self.stats.begin(), exc.status, exc.reason)
            await context.abort(grpc.StatusCode[exc.status], str(exc))
        return account, {HEADER: key} if key else {}

    async def metadata(self, body: bytes, context: Context) -> bytes:
        """Metadata from a usable backend that serves the model asked for."""
        _, headers = await self.gate(context, door.TENANT)
        try:
            read = facts.read(body, facts.METADATA)
        except peek.Malformed as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        want = Want(read.model, read.version)
        reply = await self.ask(METADATA, body, want, context.time_remaining(), headers)
        if reply.code != 0:
            await context.abort(grpc_code(reply.code), reply.message)
        return reply.body

    async def ask(
        self,
        method: str,
        body: bytes,
        want: Want,
        timeout: float | None,
        headers: Mapping[str, str] = NO_METADATA,
    ) -> Reply:
        """A control call (`method`, unary) answered by the first usable backend that serves
        `want` and answers. It stays out of the routing record (no budget, no breaker
        verdict, no latency sample), so it can neither open nor close a breaker; the
        planner's table still says which failures mean "ask the next one". The answer: the
        backend's, the pool's (no backend serves `want`: NOT_FOUND, ...), or UNAVAILABLE."""
        tried: list[Backend] = []
        last: Reply | None = None  # a backend's NOT_FOUND: the answer if no other has it
        while True:
            choice = self.pool.choose(None, tried, want)
            backend = choice.backend
            if backend is None:
                if last is not None:
                    return last
                if choice.code != Code.UNAVAILABLE:
                    return Reply(choice.code, choice.why)
                return Reply(Code.UNAVAILABLE, f"no backend can answer {method}: {choice.why}")
            tried.append(backend)
            reply: Reply = await backend.transport.unary(method, body, headers, timeout)
            if reply.code == 0 or not rule_of(reply.code, reply.retryable).retry:
                return reply
            if reply.code == Code.NOT_FOUND:
                last = reply

    async def health(self, body: bytes, context: Context) -> bytes:
        """The balancer's health; its backends' details only for an admin when auth is on,
        and the tenants as the caller may see them."""
        account, _ = await self.gate(context, door.OPEN)
        try:
            request = pb.HealthRequest.FromString(body)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a HealthRequest: {exc}")
        total = max(self.pool.calls, 1)
        default = self.pool.default_model()  # none when the servers disagree
        backends = list(self.pool.backends.values())
        serving = self.pool.serving()
        if request.model:  # that model's health: the servers that serve it
            route = self.pool.route(Want(request.model))
            if route.refusal is not None:
                await context.abort(grpc_code(route.refusal.code), route.refusal.why)
            backends = route.holders
            serving = any(b.usable for b in backends)
        listed = served(backends, default if isinstance(default, str) else "")
        response = pb.HealthResponse(
            role="balancer",
            node_id=self.node_id,
            status="SERVING" if serving else "NOT_SERVING",
            models=[m for m in listed if not request.model or m.name == request.model],
            **health_fields(self.stats),
            backends=[
                pb.BackendStatus(
                    address=b.address,
                    health=b.health,
                    breaker=b.breaker.state.value,
                    in_flight=b.in_flight,
                    calls=b.calls,
                    failures=b.failures,
                    ewma_ms=b.latency.current() * 1000,
                    share=b.calls / total,
                    limit=self.planner.limits.limit(b) or 0.0,
                    models=served([b], b.default),
                    reason=b.down,
                )
                for b in backends
                if self.tenants is None or (account is not None and account.tenant.admin)
            ],
            balancer=pb.BalancerStats(
                calls=self.pool.calls,
                retries=self.budget.retries,
                retries_refused=self.budget.refused,
                unavailable=self.planner.unavailable,
                shed=self.planner.limits.shed,
            ),
        )
        report.fill(response.balancer, self.planner.hedging)
        if self.tenants is not None:
            response.tenants.extend(door.statuses(self.tenants, account))
        return response.SerializeToString()


def served(backends: Iterable[Backend], default: str) -> list[pb.ModelStatus]:
    """The models `backends` serve as they last said, each with its versions merged newest
    first (as a server orders them); `default` (a model's name) is marked as the default."""
    versions: dict[str, set[str]] = {}
    for backend in backends:
        for name, ready in (backend.models or {}).items():
            versions.setdefault(name, set()).update(ready)
    return [
        pb.ModelStatus(
            name=name,
            versions=sorted(versions[name], key=version_key, reverse=True),
            default=name == default,
        )
        for name in sorted(versions)
    ]
