"""One server as the balancer sees it: a channel, multiplexed streams, unary calls for the
rest, a health watch, and the models it serves, asked for again and again."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Mapping

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.balancer.settings import BalancerSettings
from sluice.core.errors import Code, SluiceError
from sluice.core.limits import too_large
from sluice.routing.pool import Health
from sluice.runtime.probe import NAME_FAILED, NO_CONNECTION, Port, Shown, resolving, untrusted
from sluice.runtime.tls import ClientTLS, aio_channel
from sluice.v1 import inference_pb2 as pb
from sluice.wire import unary
from sluice.wire.mux import MuxStream, Reply
from sluice.wire.stream import request_size

log = logging.getLogger("sluice.upstream")


# How a hung server is found (docs/DESIGN.md, "Balancer"): a ping after PING_AFTER x
# keepalive_s of silence, unanswered for keepalive_s, closes the connection. grpc throttles
# pings to one a second unless DATA came in since, so health checks every CHECK_EVERY bring
# DATA; one unanswered for WEDGED_PERIODS x keepalive_s finds a wedged event loop.
PING_AFTER = 0.3  # of keepalive_s without a byte read
CHECK_EVERY = 0.15  # of keepalive_s
WEDGED_PERIODS = 10
MAX_BACKOFF_S = 0.5  # between attempts to reach a server that is gone
HEALTH = "/sluice.v1.Inference/Health"
NO_METADATA: Mapping[str, str] = {}
REFRESH_TIMEOUT_S = 1.0
_NOT_FOUND = int(Code.NOT_FOUND)
# Findings that a restart shows too (membership.outage).
REFUSES = "refuses connections"
UNREACHABLE = "unreachable"
NO_ANSWER = "does not answer"
UNTRUSTED = "presents a certificate --upstream-tls-ca does not trust: give the CA that signed it"
OTHER_NAME = (
    "presents a certificate for another name than the balancer checks (--upstream-server-name, "
    "default the backend's host): give a name the certificate holds"
)
Models = dict[str, tuple[str, ...]]


def channel_options(keepalive_s: float) -> list[tuple[str, int]]:
    """A channel to one server: no message limits, and the pings that find a stopped one."""
    timeout_ms = max(1, round(keepalive_s * 1000))
    return [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.keepalive_time_ms", max(1, round(keepalive_s * 1000 * PING_AFTER))),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # A BDP ping after the last DATA frame held the next ping back 1 s; a fixed window
        # costs nothing on a LAN (measured).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 4 * 1024 * 1024),
        # keepalive_timeout_ms alone left a stopped server's connection open (grpc 1.6x).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # Else grpc stops pinging an idle connection after two. Servers allow it.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # A restarted server back in traffic fast (2 s caps slowed rolling restarts).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF_S * 1000)),
    ]


def unreached(exc: grpc.aio.AioRpcError) -> str:
    """Why a health watch could not reach its server, in a refusal's short words."""
    if "Connection refused" in (exc.details() or ""):
        return REFUSES
    return f"{UNREACHABLE} ({exc.code().name})"


def mismatch(port: Port, shown: Shown, details: str = "") -> str:
    """The TLS mismatch between what the balancer showed (`shown`) and what a probe found or
    grpc said (`details`), with the flag that fixes it ("" if none is seen)."""
    if shown.tls and untrusted(details):
        return UNTRUSTED
    if shown.tls and NAME_FAILED in details:
        return OTHER_NAME
    if not shown.tls and port in (Port.TLS, Port.TLS_CLOSED):
        return "speaks TLS: give the balancer --upstream-tls-ca" + (
            " (and --upstream-tls-cert/--upstream-tls-key: it wants a client certificate)"
            if port is Port.TLS_CLOSED
            else ""
        )
    if shown.tls and port is Port.PLAINTEXT:
        return "is plaintext: drop --upstream-tls-ca"
    if shown.tls and port is Port.TLS_CLOSED:
        if shown.certificate:
            return (
                "refuses the balancer's client certificate (--upstream-tls-cert): is it "
                "signed by a CA in the server's --tls-client-ca?"
            )
        return "wants a client certificate: --upstream-tls-cert/--upstream-tls-key"
    return ""


def upstream_tls(settings: BalancerSettings) -> ClientTLS | None:
    """TLS to the servers (None: plaintext); SluiceError if a file does not load."""
    if not settings.upstream_tls_ca:
        return None
    try:
        return ClientTLS.of(
            ca=settings.upstream_tls_ca,
            cert=settings.upstream_tls_cert,
            key=settings.upstream_tls_key,
            server_name=settings.upstream_server_name,
        )
    except OSError as exc:
        raise SluiceError(f"--upstream-tls-ca/-cert/-key: {exc}") from None


class Upstream:
    def __init__(
        self,
        address: str,
        *,
        streams: int = 1,
        max_in_flight: int = 256,
        keepalive_s: float = 1.0,
        tls: ClientTLS | None = None,
        certificate: bool = False,
    ) -> None:
        self.address = address
        self.shown = Shown(tls is not None, certificate)
        self.channel = aio_channel(address, tls, channel_options(keepalive_s))
        self.streams = [
            MuxStream(self.channel, max_in_flight=max_in_flight) for _ in range(streams)
        ]
        self._turn = itertools.cycle(self.streams)
        self._keepalive_s = keepalive_s
        self._tasks: list[asyncio.Task[None]] = []
        self.hung = False  # out until a health check is answered
        # From its Health (0: unknown). A larger request on a stream would end the stream,
        # and every call on it.
        self.max_message_bytes = 0
        self._refresh = asyncio.Event()

    async def predict(
        self, body: bytes, metadata: Mapping[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        """A Predict, or `method`'s call, on a stream; one over the server's limit is refused
        (RESOURCE_EXHAUSTED) and not sent."""
        size = request_size(self.max_message_bytes, body, metadata, timeout, method)
        if size:
            why = too_large(
                "request",
                size,
                f"the server at {self.address}",
                self.max_message_bytes,
                " as the server receives it",
            )
            return Reply(Code.RESOURCE_EXHAUSTED, why, sent=False)
        return self._heard(await next(self._turn).call(body, metadata, timeout, method))

    async def unary(
        self, method: str, body: bytes, metadata: Mapping[str, str], timeout: float | None
    ) -> Reply:
        stub = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        return self._heard(await unary.attempt(stub, body, tuple(metadata.items()), timeout))

    def _heard(self, reply: Reply) -> Reply:
        if reply.code == _NOT_FOUND:  # a model it served is gone
            self._refresh.set()
        return reply

    def watch_models(self, every_s: float, report: Callable[[Models | None, str], None]) -> None:
        """Report (models, default) from the server's Health every `every_s` and when asked.
        A refresh that fails reports nothing (reachability is the health watch's business);
        a server older than model lists reports None: any call may go there."""

        async def refresh() -> None:
            timeout = max(every_s, REFRESH_TIMEOUT_S)
            self._refresh.set()
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._refresh.wait(), every_s)
                self._refresh.clear()
                reply = await self.unary(HEALTH, b"", NO_METADATA, timeout)
                if reply.code != 0:
                    log.debug(
                        "models of %s: status %d: %s", self.address, reply.code, reply.message
                    )
                    continue
                try:
                    health = pb.HealthResponse.FromString(reply.body)
                except DecodeError as exc:
                    log.warning("models of %s: not a HealthResponse: %s", self.address, exc)
                    continue
                self.max_message_bytes = health.max_message_bytes
                if not health.models and health.model.name:
                    report(None, "")
                    continue
                default = next((m.name for m in health.models if m.default), "")
                report({m.name: tuple(m.versions) for m in health.models}, default)

        self._tasks.append(asyncio.create_task(refresh()))

    def watch_health(self, report: Callable[[str, bool, str], None]) -> None:
        """Report (state, unreachable, why) as the health watch says, reconnecting with
        backoff. An unreachable server counts as a failure once per outage, and not at all
        if it said it was going, so a long outage keeps no breaker open after it returns.
        grpc says only UNAVAILABLE of a TLS mismatch, so a connection that never formed is
        probed once per outage, and the finding stands as why."""

        async def watch() -> None:
            stub = health_pb2_grpc.HealthStub(self.channel)
            backoff = 0.05
            announced = False  # it said it was not serving: its absence is expected
            lost = False  # this outage was already counted
            found: str | None = None  # this outage's probe's finding
            while True:
                unreachable = False
                try:
                    async for update in stub.Watch(health_pb2.HealthCheckRequest()):
                        serving = update.status == health_pb2.HealthCheckResponse.SERVING
                        announced = not serving
                        lost = False
                        found = None
                        if serving:  # what it serves may have changed
                            self._refresh.set()
                        report(Health.SERVING if serving else Health.NOT_SERVING, False, "")
                        backoff = 0.05
                except grpc.aio.AioRpcError as exc:
                    log.debug("health watch of %s: %s", self.address, exc.code().name)
                    unreachable = not announced and not lost
                    lost = True
                    why = unreached(exc)
                    if why == REFUSES:
                        found = None  # probe what listens there next
                    elif found is None and NO_CONNECTION in (exc.details() or ""):
                        report(Health.NOT_SERVING, unreachable, why)  # out before the probe
                        unreachable = False
                        found = await self._mismatch(exc.details() or "")
                    why = found or why
                else:
                    announced = True  # a watch that ended cleanly: shutting down
                    why = ""
                report(Health.NOT_SERVING, unreachable, why)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

        async def probe() -> None:
            # For a server that answers pings but whose event loop answers nothing; a stopped
            # one is the pings' (and the watch's) business.
            stub = health_pb2_grpc.HealthStub(self.channel)
            loop = asyncio.get_running_loop()
            period = self._keepalive_s * CHECK_EVERY
            while True:
                asked = loop.time()
                try:
                    reply = await stub.Check(
                        health_pb2.HealthCheckRequest(),
                        timeout=WEDGED_PERIODS * self._keepalive_s,
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not self.hung:
                        self.hung = True
                        log.warning("backend %s %s: taken out", self.address, NO_ANSWER)
                        report(Health.NOT_SERVING, True, NO_ANSWER)
                        for stream in self.streams:
                            await stream.close()  # its waiting calls are retried
                else:
                    if self.hung:
                        self.hung = False
                        log.info("backend %s answers again", self.address)
                        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                        if serving:
                            self._refresh.set()
                        report(Health.SERVING if serving else Health.NOT_SERVING, False, "")
                # Their replies are the DATA frames that keep pings unthrottled.
                await asyncio.sleep(max(0.0, asked + period - loop.time()))

        self._tasks += [asyncio.create_task(watch()), asyncio.create_task(probe())]

    async def _mismatch(self, details: str) -> str:
        """The TLS mismatch grpc's `details` name, or else a probe finds ("" if none)."""
        said = mismatch(Port.UNKNOWN, self.shown, details)
        return said or mismatch(await resolving(self.address), self.shown)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            await stream.close()
        await self.channel.close(grace=None)
