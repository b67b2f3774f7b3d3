"""The balancer's gRPC face: the same sluice.v1.Inference API as a server, forwarding raw
bytes (the body is never parsed) to the backend the pool chooses, with retries for calls
that never reached a model, within a retry budget and the caller's deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
from google.protobuf.message import DecodeError

from sluice.core.keys import NO_CACHE_HEADER, affinity_key
from sluice.core.stats import ServingStats, health_fields
from sluice.routing.budget import RetryBudget
from sluice.routing.pool import Backend, Pool
from sluice.v1 import inference_pb2 as pb
from sluice.wire import stream
from sluice.wire.mux import Reply, StreamBroken

log = logging.getLogger("sluice.balancer")

SERVICE = "sluice.v1.Inference"
PREDICT = f"/{SERVICE}/Predict"
METADATA = f"/{SERVICE}/Metadata"
FORWARDED = ("x-request-id", NO_CACHE_HEADER)
# Statuses that say the backend failed, not the caller: they count against its breaker.
BACKEND_FAILURES = {
    grpc.StatusCode.UNAVAILABLE.value[0],
    grpc.StatusCode.INTERNAL.value[0],
    grpc.StatusCode.UNKNOWN.value[0],
}
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
CODES = {code.value[0]: code for code in grpc.StatusCode}
Context = grpc.aio.ServicerContext[bytes, bytes]


class BalancerService:
    def __init__(
        self,
        pool: Pool,
        budget: RetryBudget,
        *,
        node_id: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.budget = budget
        self.node_id = node_id
        self.clock = clock
        self.stats = ServingStats(clock=clock)
        self.unavailable = 0

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

    async def predict(self, body: bytes, context: Context) -> bytes:
        metadata = {k: str(v) for k, v in context.invocation_metadata() or ()}
        remaining = context.time_remaining()
        deadline = None if remaining is None else self.clock() + remaining
        reply = await self.forward(body, metadata, deadline)
        context.set_trailing_metadata(tuple(reply.trailers.items()))
        if reply.code == 0:
            return reply.body
        await context.abort(CODES[reply.code], reply.message)

    async def predict_stream(self, requests: AsyncIterator[bytes], context: Context) -> None:
        """Clients may multiplex too: each message is forwarded on its own."""

        async def answer(message: pb.StreamRequest) -> bytes:
            deadline = self.clock() + message.timeout_s if message.timeout_s > 0 else None
            reply = await self.forward(message.request, dict(message.metadata), deadline)
            return pb.StreamResponse(
                id=message.id,
                code=reply.code,
                message=reply.message,
                response=reply.body,
                trailers=reply.trailers,
            ).SerializeToString()

        await stream.serve(requests, context.write, answer)

    async def forward(
        self, body: bytes, metadata: Mapping[str, str], deadline: float | None
    ) -> Reply:
        started = self.stats.begin()
        reply = await self._route(body, metadata, deadline)
        error = None if reply.code == 0 else CODES[reply.code].name
        self.stats.end(started, error)
        return reply

    async def _route(
        self, body: bytes, metadata: Mapping[str, str], deadline: float | None
    ) -> Reply:
        key = affinity_key(body, metadata)
        forwarded = {k: metadata[k] for k in FORWARDED if k in metadata}
        self.budget.deposit()
        tried: list[Backend] = []
        last = ""
        while True:
            remaining = None if deadline is None else deadline - self.clock()
            if remaining is not None and remaining <= 0:
                return Reply(DEADLINE_EXCEEDED, f"the deadline passed{last}")
            choice = self.pool.choose(key, tried)
            backend = choice.backend
            if backend is None:
                self.unavailable += 1
                return Reply(UNAVAILABLE, f"no backend can take the call: {choice.why}{last}")
            tried.append(backend)
            if not self.pool.start(backend):
                continue  # its single half-open probe is out: try the next one
            sent = self.clock()
            try:
                reply: Reply = await backend.transport.predict(body, forwarded, remaining)
            except StreamBroken as exc:
                self.pool.finish(backend, self.clock() - sent, "failed")
                last = f"; {backend.address}: {exc}"
            except TimeoutError:
                self.pool.finish(backend, self.clock() - sent, "slow")
                return Reply(DEADLINE_EXCEEDED, f"{backend.address} did not answer in time")
            except asyncio.CancelledError:
                self.pool.finish(backend, self.clock() - sent, "neutral")
                raise
            else:
                failed = reply.code in BACKEND_FAILURES
                self.pool.finish(backend, self.clock() - sent, "failed" if failed else "ok")
                if not reply.retryable:
                    return reply
                last = f"; {backend.address}: {reply.message}"
            if not self.budget.withdraw():
                return Reply(UNAVAILABLE, f"retry budget exhausted{last}")

    async def metadata(self, body: bytes, context: Context) -> bytes:
        tried: list[Backend] = []
        while (backend := self.pool.choose(None, tried).backend) is not None:
            tried.append(backend)
            reply: Reply = await backend.transport.unary(
                METADATA, body, {}, context.time_remaining()
            )
            if reply.code == 0:
                return reply.body
            if reply.code not in BACKEND_FAILURES:
                await context.abort(CODES[reply.code], reply.message)
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
                )
                for b in self.pool.backends.values()
            ],
            balancer=pb.BalancerStats(
                calls=self.pool.calls,
                retries=self.budget.retries,
                retries_refused=self.budget.refused,
                unavailable=self.unavailable,
            ),
        )
        return response.SerializeToString()
