"""One server as the balancer sees it: a channel, multiplexed streams for Predict (and
ModelInfer), unary calls for the rest, a grpc.health.v1 Watch that reports its serving
state, and the models it serves, asked for again and again (sluice.v1 Health)."""

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


# How a hung server is found, at the default `--keepalive-s 1`:
# - stopped or unreachable (SIGSTOP, a wedged host, a partition): an HTTP/2 ping, answered
#   by grpc's own threads whatever the server's event loop is doing, goes out when nothing
#   was read for PING_AFTER x keepalive_s; one unanswered for keepalive_s closes the
#   connection. Its health watch and streams break at once (NOT_SERVING; waiting calls are
#   retried elsewhere): found within 1.3 x keepalive_s of its last byte, idle or loaded.
#   grpc lets a client ping at most once a second unless a DATA frame came in since its
#   last ping; the health checks below, twice as often as PING_AFTER, bring those DATA
#   frames and keep a healthy connection from needing pings at all, so the ping that finds
#   a stopped server is not held back (without them an idle balancer took up to 1 s + the
#   timeout).
# - alive but its event loop wedged (pings answered, calls not): a health check unanswered
#   for WEDGED_PERIODS x keepalive_s takes it out the same way. A busy server answers late
#   but answers, and stays in: its slowness is the pool's latency outlier rule's business
#   (capped), not a hang (uncapped).
PING_AFTER = 0.3  # of keepalive_s without a byte read
CHECK_EVERY = 0.15  # of keepalive_s: well within PING_AFTER (see above)
WEDGED_PERIODS = 10
MAX_BACKOFF_S = 0.5  # between attempts to reach a server that is gone
HEALTH = "/sluice.v1.Inference/Health"
NO_METADATA: Mapping[str, str] = {}
# The least time a models refresh may take before it is given up (until the next one).
REFRESH_TIMEOUT_S = 1.0
_NOT_FOUND = int(Code.NOT_FOUND)
# A backend's findings that a restart shows too (sluice.balancer.membership.outage): it
# refuses connections, is unreachable (and grpc's code, in brackets), or does not answer.
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
    """The options of a channel to one server: no message limits, and the keepalive pings
    that find a stopped server (see above)."""
    timeout_ms = max(1, round(keepalive_s * 1000))
    return [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.keepalive_time_ms", max(1, round(keepalive_s * 1000 * PING_AFTER))),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # No BDP pings: one sent (and answered) after the last DATA frame holds the next
        # ping back for 1 s, and a stopped server was found only after 2 s. A fixed window
        # instead; on a LAN it is no limit (measured: the same calls/s either way).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 4 * 1024 * 1024),
        # grpc core (1.6x and later) times pings out by this one; keepalive_timeout_ms
        # alone left a stopped server's connection open (measured: no failure in 8 s).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # By default grpc stops pinging after two pings with no data sent between them:
        # an idle balancer would stop watching. Servers allow it (listener).
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # A restarted server is back in traffic within about this of serving (a rolling
        # restart waited up to 2 s more at grpc's and our old 2 s caps); a refused connect
        # to a dead port twice a second costs nothing worth saving.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF_S * 1000)),
    ]


def unreached(exc: grpc.aio.AioRpcError) -> str:
    """Why a health watch could not reach its server, as a refusal names a backend: grpc's
    own words are long and the same whatever the call."""
    if "Connection refused" in (exc.details() or ""):
        return REFUSES
    return f"{UNREACHABLE} ({exc.code().name})"


def mismatch(port: Port, shown: Shown, details: str = "") -> str:
    """The TLS mismatch between what the balancer showed a server (`shown`: its
    --upstream-tls-* flags) and what a probe found at its port, or what grpc said of a
    connection that failed (`details`: a certificate not trusted, or not for the name
    checked), with the flag that fixes it ("" if none is seen)."""
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
    """TLS to the servers as the --upstream-tls-* flags say (None: plaintext); SluiceError if
    a file does not load, so a bad flag stops the balancer at start."""
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
        # What it shows the server (TLS, a client certificate): a probe's finding is read
        # against it.
        self.shown = Shown(tls is not None, certificate)
        # Its health watch, models refresh and streams all ride this one channel.
        self.channel = aio_channel(address, tls, channel_options(keepalive_s))
        self.streams = [
            MuxStream(self.channel, max_in_flight=max_in_flight) for _ in range(streams)
        ]
        self._turn = itertools.cycle(self.streams)
        self._keepalive_s = keepalive_s
        self._tasks: list[asyncio.Task[None]] = []
        self.hung = False  # a health check went unanswered: out until one is answered
        # The largest message the server takes, as its Health says (0: not said, not
        # checked). A larger request is refused here: on a stream, grpc at the server would
        # end the stream, and every call on it, for it.
        self.max_message_bytes = 0
        # Ask for its models now: it (re)started serving, or said it lacks a model.
        self._refresh = asyncio.Event()

    async def predict(
        self, body: bytes, metadata: Mapping[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        """A Predict, or the stream method `method` names ("ModelInfer"), on a stream; one
        over the server's limit is refused (RESOURCE_EXHAUSTED, naming it) and not sent."""
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
        if reply.code == _NOT_FOUND:  # a model it served is gone: learn what it serves now
            self._refresh.set()
        return reply

    def watch_models(self, every_s: float, report: Callable[[Models | None, str], None]) -> None:
        """Report (models, default) as the server's sluice.v1 Health lists them: every
        `every_s`, and at once when asked (`_refresh`). A refresh that fails or is not
        answered within max(every_s, REFRESH_TIMEOUT_S) reports nothing: what the server
        said last stands, and whether it is reachable is the health watch's business (so
        refreshes never touch its breaker). A server that lists no models but names its
        model (one older than model lists) reports None: any call may go there."""

        async def refresh() -> None:
            timeout = max(every_s, REFRESH_TIMEOUT_S)
            self._refresh.set()  # the first at once
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
        """Report (state, unreachable, why): SERVING / NOT_SERVING as the server's health
        watch says (why ""); a server the watch cannot reach is NOT_SERVING, why says what
        was found (it refuses connections, does not answer, a TLS mismatch, ...), and it is
        unreachable (a backend failure) once per outage, unless it said it was going
        (NOT_SERVING, or a watch that ended cleanly): a drained server's absence until it
        serves again is no fault, and neither kind of absence may pile failures on its
        breaker while it is gone (a long outage would keep it out for many seconds after it
        returns). Reconnects with backoff.

        grpc says only UNAVAILABLE of a TLS mismatch (plaintext to a TLS port, no client
        certificate for a mutual-TLS one, TLS to a plaintext one): a connection that never
        formed and was not refused is probed once per outage (sluice.runtime.probe's
        `resolving`, a name resolved first, at most PROBE_S; the reconnect waits for it), and
        what it finds stands as why until the server answers or refuses connections. A
        certificate the balancer does not trust, or one for another name, grpc names itself:
        no probe then."""

        async def watch() -> None:
            stub = health_pb2_grpc.HealthStub(self.channel)
            backoff = 0.05
            announced = False  # it said it was not serving: its absence is expected
            lost = False  # this outage was already counted against it
            found: str | None = None  # this outage's probe's finding (None: not probed)
            while True:
                unreachable = False
                try:
                    async for update in stub.Watch(health_pb2.HealthCheckRequest()):
                        serving = update.status == health_pb2.HealthCheckResponse.SERVING
                        announced = not serving
                        lost = False
                        found = None
                        if serving:  # new, or back: what it serves may have changed
                            self._refresh.set()
                        report(Health.SERVING if serving else Health.NOT_SERVING, False, "")
                        backoff = 0.05
                except grpc.aio.AioRpcError as exc:
                    log.debug("health watch of %s: %s", self.address, exc.code().name)
                    unreachable = not announced and not lost
                    lost = True
                    why = unreached(exc)
                    if why == REFUSES:
                        found = None  # nothing listens: probe what listens there next
                    elif found is None and NO_CONNECTION in (exc.details() or ""):
                        report(Health.NOT_SERVING, unreachable, why)  # out now, not after it
                        unreachable = False
                        found = await self._mismatch(exc.details() or "")
                    why = found or why
                else:
                    announced = True  # a watch that ended cleanly: a server shutting down
                    why = ""
                report(Health.NOT_SERVING, unreachable, why)
                await asyncio.sleep(backoff)  # reconnect backoff, not a poll
                backoff = min(backoff * 2, MAX_BACKOFF_S)

        async def probe() -> None:
            # The backstop for a server whose connection lives (pings answered) but whose
            # event loop answers nothing: one unanswered for WEDGED_PERIODS x keepalive_s
            # takes it out, and the calls waiting on its streams fail as broken, so the planner
            # retries them. A stopped server is found sooner by the pings (its checks then
            # fail with UNAVAILABLE, which is the health watch's news, not a verdict here).
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
                            await stream.close()  # its waiting calls: StreamBroken
                else:
                    if self.hung:
                        self.hung = False
                        log.info("backend %s answers again", self.address)
                        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                        if serving:
                            self._refresh.set()
                        report(Health.SERVING if serving else Health.NOT_SERVING, False, "")
                # One check at a time, one per CHECK_EVERY x keepalive_s at most: their
                # replies are the DATA frames that keep pings unthrottled (see above).
                await asyncio.sleep(max(0.0, asked + period - loop.time()))

        self._tasks += [asyncio.create_task(watch()), asyncio.create_task(probe())]

    async def _mismatch(self, details: str) -> str:
        """The TLS mismatch grpc's `details` name, or else a probe of the server's port finds
        ("" if none), within the probe's bound."""
        said = mismatch(Port.UNKNOWN, self.shown, details)  # grpc's words alone: no probe
        return said or mismatch(await resolving(self.address), self.shown)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            await stream.close()
        await self.channel.close(grace=None)
