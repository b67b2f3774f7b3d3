"""The balancer's gRPC face: the same sluice.v1.Inference API as a server, forwarding raw
bytes (the body is never parsed) to the backend the pool chooses. The attempt loop (retries
within a retry budget and the caller's deadline, what counts against a backend) is the
shared call planner, sluice.routing.planner."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
from google.protobuf.message import DecodeError

from sluice.core.calls import check_request_id, stream_timeout
from sluice.core.errors import Code, InvalidInput, status_name
from sluice.core.keys import NO_CACHE_HEADER, OVERLOADED, REFUSED_HEADER, affinity_key
from sluice.core.stats import ServingStats, health_fields
from sluice.routing.budget import RetryBudget
from sluice.routing.planner import Planner, rule_of
from sluice.routing.pool import Backend, Pool
from sluice.runtime.status import grpc_code
from sluice.v1 import inference_pb2 as pb
from sluice.wire import stream
from sluice.wire.mux import Reply, StreamBroken

log = logging.getLogger("sluice.balancer")

SERVICE = "sluice.v1.Inference"
METADATA = f"/{SERVICE}/Metadata"
FORWARDED = ("x-request-id", NO_CACHE_HEADER)
NO_METADATA: Mapping[str, str] = {}
Context = grpc.aio.ServicerContext[bytes, bytes]


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
    ) -> None:
        self.pool = pool
        self.budget = budget
        self.node_id = node_id
        self.default_timeout_s = default_timeout_s  # for calls that carry no deadline
        self.clock = clock
        self.stats = ServingStats(clock=clock)
        # A stream that broke before the reply fails its calls with StreamBroken.
        self.planner = Planner(pool, budget, Reply, broken=(StreamBroken,), clock=clock)

    def handler(self) -> grpc.GenericRpcHandler[bytes, bytes]:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Predict": grpc.unary_unary_rpc_method_handler(self.predict),
                "PredictStream": grpc.stream_stream_rpc_method_handler(self.predict_stream),
                "Health": grpc.unary_unary_rpc_method_handler(self.health),
                "Metadata": grpc.unary_unary_rpc_method_handler(self.metadata),
            },
        )

    def _deadline(self, remaining: float | None) -> float | None:
        """The call's deadline on our clock; `default_timeout_s` for a call that has none."""
        if remaining is None:
            remaining = self.default_timeout_s
        return None if remaining is None else self.clock() + remaining

    async def predict(self, body: bytes, context: Context) -> bytes:
        metadata = {
            k: v if isinstance(v, str) else v.decode("latin-1")
            for k, v in context.invocation_metadata() or ()
        }
        refused = refusal(metadata)
        if refused is not None:
            self._refused()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        reply = await self.forward(body, metadata, self._deadline(context.time_remaining()))
        trailers = reply.trailers
        if reply.retryable and REFUSED_HEADER not in trailers:  # refused here, not upstream
            trailers = {**trailers, REFUSED_HEADER: OVERLOADED}
        context.set_trailing_metadata(tuple(trailers.items()))
        if reply.code == 0:
            return reply.body
        await context.abort(grpc_code(reply.code), reply.message)

    async def predict_stream(self, requests: AsyncIterator[bytes], context: Context) -> None:
        """Clients may multiplex too: each message is forwarded on its own."""

        async def answer(message: pb.StreamRequest) -> bytes:
            metadata, timeout = dict(message.metadata), message.timeout_s
            refused = refusal(metadata, timeout)
            if refused is not None:
                self._refused()
                return pb.StreamResponse(
                    id=message.id, code=Code.INVALID_ARGUMENT, message=refused
                ).SerializeToString()
            deadline = self._deadline(stream_timeout(timeout))
            reply = await self.forward(message.request, metadata, deadline)
            return pb.StreamResponse(
                id=message.id,
                code=reply.code,
                message=reply.message,
                response=reply.body,
                trailers=reply.trailers,
                retryable=reply.retryable,
            ).SerializeToString()

        await stream.serve(requests, context.write, answer)

    def _refused(self) -> None:
        """Count a call refused before any forwarding."""
        self.stats.end(self.stats.begin(), "INVALID_ARGUMENT")

    async def forward(
        self, body: bytes, metadata: Mapping[str, str], deadline: float | None
    ) -> Reply:
        """One Predict through the planner: each attempt goes over the chosen backend's
        multiplexed streams with the time left."""
        started = self.stats.begin()
        forwarded = {k: metadata[k] for k in FORWARDED if k in metadata}
        try:
            reply = await self.planner.run(
                affinity_key(body, metadata),
                deadline,
                lambda backend, left: backend.transport.predict(body, forwarded, left),
            )
        except BaseException:  # cancelled by its caller: it is not in flight any more
            self.stats.end(started, "CANCELLED")
            raise
        self.stats.end(started, None if reply.code == 0 else status_name(reply.code))
        return reply

    async def metadata(self, body: bytes, context: Context) -> bytes:
        """Metadata from the first usable backend that answers. A control call: it stays out
        of the routing record (no budget, no breaker verdict, no latency sample), so it can
        neither open nor close a breaker; the planner's table still says which failures
        mean "ask the next one"."""
        tried: list[Backend] = []
        while (backend := self.pool.choose(None, tried).backend) is not None:
            tried.append(backend)
            reply: Reply = await backend.transport.unary(
                METADATA, body, NO_METADATA, context.time_remaining()
            )
            if reply.code == 0:
                return reply.body
            if not rule_of(reply.code, reply.retryable).retry:
                await context.abort(grpc_code(reply.code), reply.message)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no backend can answer Metadata")

    async def health(self, body: bytes, context: Context) -> bytes:
        try:
            pb.HealthRequest.FromString(body)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a HealthRequest: {exc}")
        total = max(self.pool.calls, 1)
        response = pb.HealthResponse(
            role="balancer",
            node_id=self.node_id,
            status="SERVING" if self.pool.serving() else "NOT_SERVING",
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
                )
                for b in self.pool.backends.values()
            ],
            balancer=pb.BalancerStats(
                calls=self.pool.calls,
                retries=self.budget.retries,
                retries_refused=self.budget.refused,
                unavailable=self.planner.unavailable,
                shed=self.planner.limits.shed,
            ),
        )
        return response.SerializeToString()
