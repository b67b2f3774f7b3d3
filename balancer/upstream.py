"""One server as the balancer sees it: a channel, multiplexed streams for Predict, unary
calls for the rest, and a grpc.health.v1 Watch that reports its serving state."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.routing.pool import Health
from sluice.wire import unary
from sluice.wire.mux import MuxStream, Reply

log = logging.getLogger("sluice.upstream")


class Upstream:
    def __init__(
        self,
        address: str,
        *,
        streams: int = 1,
        max_in_flight: int = 256,
        keepalive_s: float = 1.0,
    ) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", -1),
                ("grpc.max_send_message_length", -1),
                # A hung server (SIGSTOP, a wedged host) answers no ping: within about
                # twice `keepalive_s` its connection is closed, its streams break (their
                # calls are retried elsewhere) and its health watch reports it out.
                ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(keepalive_s * 1000)),
                # By default grpc stops pinging after two pings with no data sent between
                # them: an idle balancer would stop watching. Servers allow it (listener).
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2_000),
            ],
        )
        self.streams = [
            MuxStream(self.channel, max_in_flight=max_in_flight) for _ in range(streams)
        ]
        self._turn = itertools.cycle(self.streams)
        self._keepalive_s = keepalive_s
        self._tasks: list[asyncio.Task[None]] = []
        self.hung = False  # a health check went unanswered: out until one is answered

    async def predict(
        self, body: bytes, metadata: Mapping[str, str], timeout: float | None
    ) -> Reply:
        return await next(self._turn).call(body, metadata, timeout)

    async def unary(
        self, method: str, body: bytes, metadata: Mapping[str, str], timeout: float | None
    ) -> Reply:
        stub = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        return await unary.attempt(stub, body, tuple(metadata.items()), timeout)

    def watch_health(self, report: Callable[[str, bool], None]) -> None:
        """Report (state, unreachable): SERVING / NOT_SERVING as the server's health watch
        says; a server the watch cannot reach is NOT_SERVING and unreachable (a backend
        failure). Reconnects with backoff."""

        async def watch() -> None:
            stub = health_pb2_grpc.HealthStub(self.channel)
            backoff = 0.05
            while True:
                unreachable = False
                try:
                    async for update in stub.Watch(health_pb2.HealthCheckRequest()):
                        serving = update.status == health_pb2.HealthCheckResponse.SERVING
                        report(Health.SERVING if serving else Health.NOT_SERVING, False)
                        backoff = 0.05
                except grpc.aio.AioRpcError as exc:
                    log.debug("health watch of %s: %s", self.address, exc.code().name)
                    unreachable = True
                # A watch that ended cleanly is a server shutting down, not a failure.
                report(Health.NOT_SERVING, unreachable)
                await asyncio.sleep(backoff)  # reconnect backoff, not a poll
                backoff = min(backoff * 2, 2.0)

        async def probe() -> None:
            # A hung server (SIGSTOP, a wedged host) sends no NOT_SERVING and may keep its
            # connection: a health check it cannot answer in time takes it out, and the
            # calls waiting on its streams fail as broken, so the planner retries them.
            # Two misses in a row, so that one slow moment of a busy server is not a hang.
            stub = health_pb2_grpc.HealthStub(self.channel)
            missed = 0
            loop = asyncio.get_running_loop()
            asked = loop.time()
            while True:
                # One check per period, a missed one included (its timeout spent the period).
                await asyncio.sleep(max(0.0, asked + self._keepalive_s - loop.time()))
                asked = loop.time()
                try:
                    reply = await stub.Check(
                        health_pb2.HealthCheckRequest(), timeout=self._keepalive_s
                    )
                except grpc.aio.AioRpcError as exc:
                    late = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    missed = missed + 1 if late else 0
                    if missed >= 2 and not self.hung:
                        self.hung = True
                        log.warning("backend %s does not answer: taken out", self.address)
                        report(Health.NOT_SERVING, True)
                        for stream in self.streams:
                            await stream.close()  # its waiting calls: StreamBroken
                    continue
                missed = 0
                if self.hung:
                    self.hung = False
                    log.info("backend %s answers again", self.address)
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    report(Health.SERVING if serving else Health.NOT_SERVING, False)

        self._tasks = [asyncio.create_task(watch()), asyncio.create_task(probe())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            await stream.close()
        await self.channel.close(grace=None)
