"""Clients over raw-bytes gRPC calls. Tensors travel as raw little-endian bytes: numpy
arrays as they are, plain values (nested lists, scalars) in the datatype the model's metadata
declares for their input (asked once per model and version, never for arrays).

One client core (`_Core`): targets, request building, routing and decoding. Given one
target (a server or a balancer) a client sends each call straight there; given several
servers it balances them itself (proxyless), with the balancer's own pool, breakers,
retry budget and call planner (sluice.routing.planner), and no extra hop. Only the asyncio
client hedges (`hedge_after_ms`); the blocking one refuses the option.
`AsyncSluiceClient` (asyncio) and `SluiceClient` (blocking, on grpc's blocking channels:
no event loop or thread of its own) add only the sending.

With `shared_memory=True` (one target, a server or balancer on this host started with
--shared-memory), tensors travel in POSIX shared memory regions the client creates,
registers and reuses (sluice.shm.client), the messages carrying only where they lie;
`predict` returns the same arrays. close() unregisters the regions and removes their objects.

Plain values need their inputs' datatypes first: the model's Metadata, asked as a Predict
is sent (several targets: through the planner, so a target that is down is passed over), within
the call's one deadline; the Predict gets the time left.

Failures raise `grpc.RpcError` whose `code()` and `details()` say what went wrong: with one
target, grpc's own error for the call; with several, the last attempt's status, or
UNAVAILABLE with the reason no server could take it (a `grpc.aio.AioRpcError`). Where grpc's
words leave out what to fix (the size limit a message was over, a TLS mismatch with the
target), sluice.client.diagnose puts it first, in a `grpc.aio.AioRpcError` of the same code,
naming this client's keywords (or, for the sluice commands, their flags: `hints`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn, Self

import grpc
import numpy as np
import numpy.typing as npt

from sluice.client import diagnose
from sluice.core.keys import NO_CACHE_HEADER, NO_CACHE_VALUE, PREDICT, affinity_key
from sluice.core.tenants import authorization
from sluice.routing.breaker import BreakerSettings
from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import HedgeSettings, Hedging
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Pool
from sluice.runtime import tracing
from sluice.runtime.status import grpc_code
from sluice.runtime.tls import ClientTLS, aio_channel, blocking_channel
from sluice.shm.client import Arena, Layout, SharedMemory, check_target, registration_error
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec, unary
from sluice.wire.mux import Reply

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Several targets: a hung one is found within (1 + PING_AFTER) x KEEPALIVE_S of its last byte,
# well within a 1 s deadline, leaving the retry the rest (`keepalive`).
KEEPALIVE_S = 0.3
PING_AFTER = 0.3  # of keepalive_s without a byte read, as the balancer's upstream channels
ChannelOptions = Sequence[tuple[str, Any]]
Metadata = tuple[tuple[str, str], ...]
Inputs = Mapping[str, npt.ArrayLike]
METADATA = "/sluice.v1.Inference/Metadata"
RAW = {"request_serializer": None, "response_deserializer": None}  # bodies as bytes
# Sends one raw body on one channel (a target's Predict channels are used in turn).
Sender = Callable[..., Any]
# One call to one target (target, body, metadata, timeout): a client's transport step.
Step = Callable[[str, bytes, Metadata, float | None], Reply]
AsyncStep = Callable[[str, bytes, Metadata, float | None], Awaitable[Reply]]
SPAN = "sluice.client/Predict"  # with tracing (sluice.runtime.tracing): one per call


@dataclass(frozen=True)
class Prediction:
    """A Predict answer: the outputs, the response metadata that came with them, and the
    model and version that answered."""

    outputs: dict[str, np.ndarray]
    metadata: dict[str, str]
    model: str = ""
    version: str = ""

    @property
    def node_id(self) -> str:
        return self.metadata.get("x-node-id", "")

    @property
    def request_id(self) -> str:
        return self.metadata.get("x-request-id", "")


def channel_options(
    max_message_bytes: int, extra: ChannelOptions, keepalive_s: float = 0.0
) -> list[tuple[str, Any]]:
    """A client channel's options: the message limits, with `keepalive_s` (0: none) the
    keepalive pings and connect bound of `keepalive`, then the caller's own `extra`."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *(keepalive(keepalive_s) if keepalive_s > 0 else ()),
        *extra,
    ]


def keepalive(keepalive_s: float) -> list[tuple[str, int]]:
    """How a client given several targets leaves one that stops answering (a blackholed or
    wedged host: no RST) for another, within a call's deadline, not after it: as the
    balancer's --keepalive-s finds a hung server. While calls are out (idle channels do not
    ping) an HTTP/2 ping goes out after PING_AFTER x keepalive_s without a byte read, and one
    unanswered for keepalive_s closes the connection, failing its calls UNAVAILABLE for the
    planner to retry elsewhere; a connect attempt is bounded by keepalive_s too (grpc's own
    minimum is 20 s, and calls wait on a connecting channel), so a target that cannot be
    reached fails its calls at once, breaker probes included. Sluice servers and balancers
    permit the pings (sluice.runtime.listener); a server that does not would answer them
    with too_many_pings."""
    timeout_ms = max(1, round(keepalive_s * 1000))
    return [
        ("grpc.keepalive_time_ms", max(1, round(keepalive_s * 1000 * PING_AFTER))),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),  # what grpc core 1.6x+ times pings by
        ("grpc.keepalive_permit_without_calls", 0),
        # A long call keeps being watched: by default pings stop after two with no data sent.
        ("grpc.http2.max_pings_without_data", 0),
        # No BDP pings: one answered just before the host went dark holds the keepalive ping
        # back for a second (balancer.upstream measured it). A fixed window instead.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 4 * 1024 * 1024),
        # grpc's connect timeout is max(min_reconnect_backoff, the backoff): both keepalive_s.
        ("grpc.min_reconnect_backoff_ms", timeout_ms),
        ("grpc.initial_reconnect_backoff_ms", min(100, timeout_ms)),
        ("grpc.max_reconnect_backoff_ms", timeout_ms),
    ]


def keepalive_of(keepalive_s: float | None, targets: Sequence[str]) -> float:
    """A client's `keepalive_s`: as given (0: off), or by default KEEPALIVE_S with several
    targets and off with one (it has no other target to fail over to: the call's own
    deadline bounds it, and a slow connect is given all of that)."""
    if keepalive_s is None:
        return KEEPALIVE_S if len(targets) > 1 else 0.0
    if keepalive_s < 0:
        raise ValueError(f"keepalive_s must be 0 (off) or more, not {keepalive_s}")
    return keepalive_s


def plain(inputs: Mapping[str, npt.ArrayLike]) -> bool:
    """Whether some input is a plain value (not a numpy array): its datatype is the model's."""
    return any(not isinstance(value, np.ndarray) for value in inputs.values())


def check_plain(inputs: Mapping[str, npt.ArrayLike]) -> None:
    """Refuse a plain value that no datatype could take (ragged, strings, None): when the
    model's metadata cannot be had, that is the caller's first thing to fix."""
    for name, value in inputs.items():
        if not isinstance(value, np.ndarray):
            codec.array_of(name, value)


def declared(meta: pb.MetadataResponse) -> dict[str, str]:
    """The model's inputs' datatypes by name."""
    return {t.name: t.datatype for t in meta.model.inputs}


def metadata_request(model: str, version: str) -> bytes:
    return pb.MetadataRequest(model=model, version=version).SerializeToString()


def call_metadata(request_id: str | None, no_cache: bool = False) -> dict[str, str]:
    metadata = {"x-request-id": request_id or os.urandom(8).hex()}
    if no_cache:
        metadata[NO_CACHE_HEADER] = NO_CACHE_VALUE
    return metadata


def rpc_error(reply: Reply) -> grpc.aio.AioRpcError:
    """A failed Reply as the error grpc raises for a failed call."""
    return grpc.aio.AioRpcError(
        grpc_code(reply.code),
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*reply.trailers.items()),
        reply.message,
        None,
    )


def status_of(exc: BaseException) -> int | None:
    """The status number of a failed grpc call, for its span."""
    code = exc.code() if isinstance(exc, grpc.RpcError) else None
    return code.value[0] if isinstance(code, grpc.StatusCode) else None


def target_list(target: str | Sequence[str]) -> list[str]:
    targets = [target] if isinstance(target, str) else list(target)
    if not targets:
        raise ValueError("give at least one target")
    return targets


def auth_metadata(api_key: str) -> Metadata:
    """The metadata that carries an API key on every call (none without one)."""
    return (authorization(api_key),) if api_key else ()


def router(
    targets: Sequence[str],
    breaker: BreakerSettings | None = None,
    hedge: HedgeSettings | None = None,
) -> Planner[Reply]:
    """The client's own balancing over several servers: a pool and a retry budget of its own
    (and, with `hedge`, hedging), driven by the shared planner."""
    pool = Pool(breaker=breaker)
    pool.set_addresses(targets)
    return Planner(pool, RetryBudget(), Reply, hedging=None if hedge is None else Hedging(hedge))


def hedge_of(hedge_after_ms: float | str | None, targets: Sequence[str]) -> HedgeSettings | None:
    """The settings of a client's `hedge_after_ms` (None or 0: off; ms, or "auto"), which
    needs several targets: one target has no other to hedge to (a balancer hedges itself,
    with --hedge-after-ms). ValueError otherwise."""
    if hedge_after_ms is None or (not isinstance(hedge_after_ms, str) and not hedge_after_ms):
        return None  # 0 and 0.0 are off, as "0" is (str(0.0) is not a word parse takes)
    hedge = HedgeSettings.parse(str(hedge_after_ms))
    if hedge is not None and len(targets) < 2:
        raise ValueError(
            "hedge_after_ms needs several targets (servers this client balances); "
            "for a balancer, start it with --hedge-after-ms"
        )
    return hedge


class _Core:
    """What both clients are: their targets, routing state, request building and decoding,
    and what a plain call decides (`_asks_datatypes`, `_learned`, `_request`, `_refused`):
    each client adds only the sending."""

    targets: list[str]
    target: str
    timeout: float | None
    _router: Planner[Reply] | None
    _clock: Callable[[], float]  # the one clock of calls' deadlines (the planner's)
    _senders: dict[str, Iterator[Sender]]
    _askers: dict[str, Sender]  # each target's raw Metadata callable
    _auth: Metadata
    _shown: diagnose.Shown | None  # None: channels the caller made, their TLS unknown
    _hints: diagnose.Audience
    # The inputs' datatypes by (model, version), asked once, for plain values only.
    _declared: dict[tuple[str, str], dict[str, str]]
    _memory: SharedMemory | None  # shared_memory=True: the regions its tensors travel in

    def _start(
        self,
        methods: Mapping[str, Sequence[Sender]],
        askers: Mapping[str, Sender],
        timeout: float | None,
        api_key: str,
        shown: diagnose.Shown | None,
        hints: diagnose.Audience,
        hedge: HedgeSettings | None = None,
    ) -> None:
        """`methods`: each target's raw-bytes Predict callables (one per channel, used in
        turn); `askers`: its raw-bytes Metadata callable; `shown`: the TLS its channels
        offer; `hints`: whose options a failed call's hint names; `hedge`: hedging (several
        targets only)."""
        self._shown = shown
        self._hints = hints
        self._declared = {}
        self.targets = target_list(list(methods))
        self.target = self.targets[0]
        self.timeout = timeout
        self._auth = auth_metadata(api_key)
        self._senders = {t: itertools.cycle(ms) for t, ms in methods.items()}
        self._askers = dict(askers)
        self._router = router(self.targets, hedge=hedge) if len(self.targets) > 1 else None
        self._clock = time.monotonic if self._router is None else self._router.clock

    def _deadline(self, timeout: float | None) -> Deadline:
        """A call's one deadline (`timeout`, else the client's): what it asks first, and
        then its Predict, share it."""
        return Deadline(timeout or self.timeout, self._clock)

    def _asks_datatypes(self, plain_values: bool, model: str, version: str) -> bool:
        """Whether this call asks the model's metadata first: a plain value (`plain_values`:
        `plain` of its inputs, found once per call) whose datatype is not known yet."""
        return plain_values and (model, version) not in self._declared

    def _learned(self, model: str, version: str, reply: Reply) -> pb.MetadataResponse:
        """A Metadata reply's answer, its inputs' datatypes kept for plain values."""
        if reply.code:
            raise rpc_error(reply)
        meta = pb.MetadataResponse.FromString(reply.body)
        self._declared[model, version] = declared(meta)
        return meta

    def _request(
        self,
        inputs: Mapping[str, npt.ArrayLike],
        plain_values: bool,
        outputs: Sequence[str],
        request_id: str | None,
        no_cache: bool,
        model: str = "",
        version: str = "",
    ) -> tuple[bytes, Metadata]:
        """A Predict's body (plain values in their declared datatypes) and metadata."""
        datatypes = self._declared.get((model, version)) if plain_values else None
        body = codec.encode_predict(inputs, outputs, model, version, datatypes)
        return body, self._metadata_of(request_id, no_cache)

    def _metadata_of(self, request_id: str | None, no_cache: bool) -> Metadata:
        return (*call_metadata(request_id, no_cache).items(), *self._auth)

    def _arrays(
        self, inputs: Inputs, plain_values: bool, model: str, version: str
    ) -> dict[str, np.ndarray]:
        """The arrays the inputs send (plain values in their declared datatypes), for a
        shared memory call to place."""
        datatypes = self._declared.get((model, version), {}) if plain_values else {}
        return {n: codec.array_of(n, v, datatypes.get(n, "")) for n, v in inputs.items()}

    def _refused(self, error: grpc.RpcError, plain_values: bool, model: str, version: str) -> None:
        """A failed Predict: a plain one refused INVALID_ARGUMENT forgets the datatypes (a
        swap may have changed them: the next call asks again)."""
        if plain_values and error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            self._declared.pop((model, version), None)

    def _terms(
        self, deadline: Deadline, body: bytes | None = None, metadata: Metadata = ()
    ) -> CallTerms:
        """The terms one call goes on: straight to the one target with the time left, or
        through the planner (each attempt gets the time left before the deadline; a Predict
        `body` routes by its ring key, other calls to the least loaded)."""
        if self._router is None:
            # A Predict is a call's last send: alone, it takes the timeout as given (no
            # clock read on the per-call path); a Metadata fixes the deadline it shares.
            return CallTerms(deadline.last() if body is not None else deadline.left(), None, None)
        timeout = deadline.left()
        key = None if body is None else affinity_key(body, dict(metadata))
        return CallTerms(timeout, key, deadline.at)

    def _routed_target(self) -> str:
        """Where a routed call went, for a hint: the one target ("" when the planner chose)."""
        return self.target if self._router is None else ""

    def _raise(self, error: grpc.RpcError, target: str) -> NoReturn:
        """Raise `error`, or with a hint of what to fix when diagnose has one (may probe
        `target`: a failed call only, bounded, and kept a while)."""
        explained = diagnose.explained(error, target, self._shown, self._hints)
        if explained is error:
            raise error
        raise explained from error


@dataclass(slots=True)
class Deadline:
    """One call's time, shared by what it sends: the first send gets `timeout` whole and
    fixes the deadline (`at`, on `clock`), the later ones get what is left of it."""

    timeout: float | None  # None: no limit
    clock: Callable[[], float]
    at: float | None = None  # set by the first `left`

    def left(self) -> float | None:
        if self.timeout is None:
            return None
        if self.at is None:
            self.at = self.clock() + self.timeout
            return self.timeout
        return max(self.at - self.clock(), 0.0)

    def last(self) -> float | None:
        """`left` for the call's last send: the timeout whole, the clock unread, when
        nothing went first (no later send needs the deadline fixed)."""
        return self.timeout if self.at is None else self.left()


@dataclass(frozen=True, slots=True)
class CallTerms:
    """One call's timeout, and with several targets its ring key and planner deadline: the
    terms it is sent on (its attempts are the planner's own `Plan`, sluice.routing.planner)."""

    timeout: float | None
    key: int | None  # with several targets: the ring key ...
    deadline: float | None  # ... and the deadline on the planner's clock


def prediction(reply: Reply) -> Prediction:
    """The answer a reply holds; a failed reply is raised as grpc raises a failed call."""
    if reply.code:
        raise rpc_error(reply)
    response = pb.PredictResponse.FromString(reply.body)
    return Prediction(
        codec.decode_all(response.outputs), reply.trailers, response.model, response.version
    )


def shared_prediction(memory: SharedMemory, plan: Layout, reply: Reply) -> Prediction:
    """`prediction` of a shared memory call: the outputs in its region copied out."""
    if reply.code:
        raise rpc_error(reply)
    response, outputs = memory.answer(plan, reply.body)
    return Prediction(outputs, reply.trailers, response.model, response.version)


class AsyncSluiceClient(_Core):
    """asyncio client; create and use it inside a running event loop. One target is a server
    or a balancer; several targets are servers that this client balances itself.

    TLS when `tls` or any TLS option is given: trusting the CAs in the PEM file `tls_ca`
    (empty: the system's), showing the certificate `tls_cert` with its key `tls_key` to a
    server that requires one (mutual TLS), and checking the server's certificate against
    `server_name` (empty: the target's host). `api_key` is sent on every call as
    `authorization: Bearer KEY`. `hints`: whose options the hint on a failed call names
    (the sluice commands pass Audience.COMMANDS: their flags and variables).

    `shared_memory`: send tensors (inputs, and outputs once the model's sizes are known
    from a first answer of the same input shapes) through POSIX shared memory regions this
    client creates and registers, reused across calls, removed by close(); for one target,
    a server or balancer on this host (127.0.0.1, localhost, [::1] or unix:; ValueError
    otherwise)
    started with --shared-memory.

    `hedge_after_ms` (several targets; None or 0: off): a call whose attempt has not
    answered after this many ms (or "auto": past the servers' recent p99 or twice their
    median) sends one hedge to another server, and the first OK answer wins
    (sluice.routing.hedge). ValueError with one target: a balancer hedges itself
    (--hedge-after-ms).

    `keepalive_s` (None: 0.3 with several targets, off with one; 0: off): while calls are
    out, a target silent for 0.3 x this is pinged, and one that leaves the ping unanswered
    this long, or cannot be connected to within it, fails its calls UNAVAILABLE, which the
    planner retries on another target with the time left (as the balancer's --keepalive-s).
    The targets must permit pings that often; Sluice servers and balancers do."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: ChannelOptions = (),
        tls: bool = False,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        server_name: str = "",
        api_key: str = "",
        hints: diagnose.Audience = diagnose.Audience.PYTHON,
        shared_memory: bool = False,
        hedge_after_ms: float | str | None = None,
        keepalive_s: float | None = None,
    ) -> None:
        targets = target_list(target)
        if shared_memory:
            check_target(targets)
        hedge = hedge_of(hedge_after_ms, targets)
        security = ClientTLS.of(
            tls=tls, ca=tls_ca, cert=tls_cert, key=tls_key, server_name=server_name
        )
        settings = channel_options(max_message_bytes, options, keepalive_of(keepalive_s, targets))
        channels = {t: [aio_channel(t, security, settings)] for t in targets}
        shown = diagnose.Shown(tls=security is not None, certificate=bool(tls_cert))
        self._attach(channels, timeout, api_key, owned=True, shown=shown, hints=hints, hedge=hedge)
        self._memory = SharedMemory() if shared_memory else None

    @classmethod
    def on_channels(
        cls,
        channels: Mapping[str, Sequence[grpc.aio.Channel]],
        *,
        timeout: float | None = 10.0,
        api_key: str = "",
        hedge_after_ms: float | str | None = None,
    ) -> Self:
        """A client over channels the caller made and closes, several per target if it likes
        (used in turn); for the load generator's connection counts."""
        client = cls.__new__(cls)
        client._attach(
            {t: list(chs) for t, chs in channels.items()},
            timeout,
            api_key,
            owned=False,
            shown=None,
            hints=diagnose.Audience.PYTHON,
            hedge=hedge_of(hedge_after_ms, list(channels)),
        )
        return client

    def _attach(
        self,
        channels: dict[str, list[grpc.aio.Channel]],
        timeout: float | None,
        api_key: str,
        *,
        owned: bool,
        shown: diagnose.Shown | None,
        hints: diagnose.Audience,
        hedge: HedgeSettings | None = None,
    ) -> None:
        methods = {t: [ch.unary_unary(PREDICT, **RAW) for ch in chs] for t, chs in channels.items()}
        askers = {t: chs[0].unary_unary(METADATA, **RAW) for t, chs in channels.items()}
        self._start(methods, askers, timeout, api_key, shown, hints, hedge)
        self._channels = channels
        self._owned = owned
        self._stub = pb_grpc.InferenceStub(channels[self.target][0])
        self._memory = None

    async def predict(
        self,
        inputs: Mapping[str, npt.ArrayLike],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str | None = None,
        no_cache: bool = False,
        model: str = "",
        version: str = "",
    ) -> dict[str, np.ndarray]:
        """Run the model (`model`, `version`: empty for the default model, its newest
        version); returns its outputs by name. `no_cache` keeps the call out of the result
        cache (and out of cache-affinity routing)."""
        answer = await self.infer(
            inputs,
            outputs=outputs,
            timeout=timeout,
            request_id=request_id,
            no_cache=no_cache,
            model=model,
            version=version,
        )
        return answer.outputs

    async def infer(
        self,
        inputs: Mapping[str, npt.ArrayLike],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str | None = None,
        no_cache: bool = False,
        model: str = "",
        version: str = "",
    ) -> Prediction:
        """Run the model; returns its outputs with the response metadata. Plain values
        (nested lists, scalars) are sent in the datatypes the model declares for them (its
        metadata, asked once per model and version); numpy arrays as they are."""
        deadline = self._deadline(timeout)
        plain_values = plain(inputs)
        if self._asks_datatypes(plain_values, model, version):
            await self._metadata(model, version, deadline, inputs)
        try:
            if self._memory is not None:
                arrays = self._arrays(inputs, plain_values, model, version)
                metadata = self._metadata_of(request_id, no_cache)
                return await self._shared(
                    self._memory, arrays, outputs, model, version, metadata, deadline
                )
            body, metadata = self._request(
                inputs, plain_values, outputs, request_id, no_cache, model, version
            )
            return prediction(await self._call(body, metadata, deadline))
        except grpc.RpcError as exc:
            self._refused(exc, plain_values, model, version)
            await self._araise(exc, self._routed_target())

    async def _shared(
        self,
        memory: SharedMemory,
        arrays: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        model: str,
        version: str,
        metadata: Metadata,
        deadline: Deadline,
    ) -> Prediction:
        """A Predict whose tensors travel in this client's shared memory; sent once more
        when the server's refusal says the next try may not be refused (SharedMemory.failed)."""
        with memory.planned(arrays, outputs, model, version) as plan:
            try:
                return await self._shared_send(memory, plan, metadata, deadline)
            except grpc.RpcError as exc:
                if not memory.failed(plan, exc):
                    raise
        with memory.planned(arrays, outputs, model, version) as plan:
            return await self._shared_send(memory, plan, metadata, deadline)

    async def _shared_send(
        self, memory: SharedMemory, plan: Layout, metadata: Metadata, deadline: Deadline
    ) -> Prediction:
        if plan.fresh:
            await self._register(plan.arena, deadline)
        return shared_prediction(memory, plan, await self._call(plan.body, metadata, deadline))

    async def _register(self, arena: Arena, deadline: Deadline) -> None:
        """Register `arena` as it is now, under its name (whatever the server held under it
        unregistered first: a smaller object, or one this client lost track of)."""
        try:
            await self._stub.UnregisterRegion(
                pb.UnregisterRegionRequest(name=arena.name),
                timeout=deadline.left(),
                metadata=self._auth,
            )
            await self._stub.RegisterRegion(
                arena.registration(), timeout=deadline.left(), metadata=self._auth
            )
        except grpc.RpcError as exc:
            raise registration_error(exc, arena.name, self.target, self._hints) from exc
        arena.registered_now()

    async def _araise(self, error: grpc.RpcError, target: str) -> NoReturn:
        """`_raise` off the event loop when it would probe the target."""
        if diagnose.needs_probe(error, target, self._shown):
            await asyncio.to_thread(self._raise, error, target)
        self._raise(error, target)

    async def call_raw(
        self,
        body: bytes,
        metadata: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """One Predict of a serialized PredictRequest; failures come back as the Reply's
        status, never raised. For the load generator."""
        sent = (*(metadata or {}).items(), *self._auth)
        try:
            return await self._call(body, sent, self._deadline(timeout))
        except grpc.aio.AioRpcError as exc:
            return unary.failure(exc)

    async def _call(self, body: bytes, metadata: Metadata, deadline: Deadline) -> Reply:
        """One Predict, traced when the application traces."""
        tracer = tracing.client_tracer()  # None unless the application traces
        if tracer is None:
            return await self._calls(
                body, metadata, self._terms(deadline, body, metadata), self._send
            )
        with tracing.client_span(tracer, SPAN, metadata, self.targets, status_of) as (span, sent):
            reply = await self._calls(body, sent, self._terms(deadline, body, sent), self._send)
            tracing.set_code(span, reply.code, reply.message, server=False)
        return reply

    async def _calls(
        self, body: bytes, metadata: Metadata, terms: CallTerms, send: AsyncStep
    ) -> Reply:
        """The call's attempts, each by `send` (`_send`: a Predict; `_ask`: a Metadata): one
        to the one target, or as the planner routes them."""
        if self._router is None:
            return await send(self.target, body, metadata, terms.timeout)

        async def attempt(backend: Backend, left: float | None) -> Reply:
            try:
                return await send(backend.address, body, metadata, left)
            except grpc.aio.AioRpcError as exc:
                return unary.failure(exc)  # for the planner to classify

        return await self._router.run(terms.key, terms.deadline, attempt)

    async def _send(
        self, target: str, body: bytes, metadata: Metadata, timeout: float | None
    ) -> Reply:
        """One Predict to one target: the transport step. Raises grpc.aio.AioRpcError."""
        return await unary.call(next(self._senders[target]), body, metadata, timeout)

    async def _ask(
        self, target: str, body: bytes, metadata: Metadata, timeout: float | None
    ) -> Reply:
        """One Metadata to one target: the transport step. Raises grpc.aio.AioRpcError."""
        return await unary.call(self._askers[target], body, metadata, timeout)

    async def health(self, *, model: str = "", timeout: float | None = None) -> pb.HealthResponse:
        """The first target's Health (a model's, when named)."""
        try:
            response: pb.HealthResponse = await self._stub.Health(
                pb.HealthRequest(model=model), timeout=timeout or self.timeout, metadata=self._auth
            )
        except grpc.RpcError as exc:
            await self._araise(exc, self.target)
        return response

    async def metadata(
        self, *, model: str = "", version: str = "", timeout: float | None = None
    ) -> pb.MetadataResponse:
        """A model's metadata (the default one unless named), from a target that can answer
        (several: as the planner routes it, passing over one that is down)."""
        return await self._metadata(model, version, self._deadline(timeout))

    async def _metadata(
        self, model: str, version: str, deadline: Deadline, inputs: Inputs | None = None
    ) -> pb.MetadataResponse:
        """`inputs`: those of the plain call that needs it: unanswered, a value of theirs
        that no datatype could take is the caller's first thing to fix (`check_plain`)."""
        body = metadata_request(model, version)
        try:
            reply = await self._calls(body, self._auth, self._terms(deadline), self._ask)
            return self._learned(model, version, reply)
        except grpc.RpcError as exc:
            if inputs is not None:
                check_plain(inputs)
            await self._araise(exc, self._routed_target())

    async def close(self) -> None:
        """Unregister this client's shared memory regions (if any), unlink their objects,
        and close the channels it made."""
        if self._memory is not None:
            for name in self._memory.registered():
                with contextlib.suppress(grpc.RpcError):  # a server gone forgot it anyway
                    await self._stub.UnregisterRegion(
                        pb.UnregisterRegionRequest(name=name),
                        timeout=self.timeout,
                        metadata=self._auth,
                    )
            self._memory.close()
        if self._owned:
            for chs in self._channels.values():
                for channel in chs:
                    await channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class SluiceClient(_Core):
    """Blocking client with the same methods and options as AsyncSluiceClient (but
    call_raw, and hedging), on grpc's blocking channels. Safe to use from several threads at
    once. It does not hedge (a blocking call has no second attempt to wait on beside its
    first): `hedge_after_ms` is refused with ValueError, naming AsyncSluiceClient."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float | None = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: ChannelOptions = (),
        tls: bool = False,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        server_name: str = "",
        api_key: str = "",
        hints: diagnose.Audience = diagnose.Audience.PYTHON,
        shared_memory: bool = False,
        hedge_after_ms: float | str | None = None,
        keepalive_s: float | None = None,
    ) -> None:
        targets = target_list(target)
        if shared_memory:
            check_target(targets)
        if hedge_of(hedge_after_ms, targets) is not None:
            raise ValueError(
                "SluiceClient does not hedge: use AsyncSluiceClient for hedge_after_ms"
            )
        security = ClientTLS.of(
            tls=tls, ca=tls_ca, cert=tls_cert, key=tls_key, server_name=server_name
        )
        settings = channel_options(max_message_bytes, options, keepalive_of(keepalive_s, targets))
        self._channels = {t: blocking_channel(t, security, settings) for t in targets}
        self._start(
            {t: [ch.unary_unary(PREDICT, **RAW)] for t, ch in self._channels.items()},
            {t: ch.unary_unary(METADATA, **RAW) for t, ch in self._channels.items()},
            timeout,
            api_key,
            diagnose.Shown(tls=security is not None, certificate=bool(tls_cert)),
            hints,
        )
        self._stub = pb_grpc.InferenceStub(self._channels[self.target])
        self._lock = threading.Lock()  # the planner's steps, when several threads call
        self._memory = SharedMemory() if shared_memory else None

    def predict(
        self,
        inputs: Mapping[str, npt.ArrayLike],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str | None = None,
        no_cache: bool = False,
        model: str = "",
        version: str = "",
    ) -> dict[str, np.ndarray]:
        """Run the model (`model`, `version`: empty for the default model, its newest
        version); returns its outputs by name. `no_cache` keeps the call out of the result
        cache (and out of cache-affinity routing)."""
        return self.infer(
            inputs,
            outputs=outputs,
            timeout=timeout,
            request_id=request_id,
            no_cache=no_cache,
            model=model,
            version=version,
        ).outputs

    def infer(
        self,
        inputs: Mapping[str, npt.ArrayLike],
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str | None = None,
        no_cache: bool = False,
        model: str = "",
        version: str = "",
    ) -> Prediction:
        """Run the model; returns its outputs with the response metadata. Plain values
        (nested lists, scalars) are sent in the datatypes the model declares for them (its
        metadata, asked once per model and version); numpy arrays as they are."""
        deadline = self._deadline(timeout)
        plain_values = plain(inputs)
        if self._asks_datatypes(plain_values, model, version):
            self._metadata(model, version, deadline, inputs)
        try:
            if self._memory is not None:
                arrays = self._arrays(inputs, plain_values, model, version)
                metadata = self._metadata_of(request_id, no_cache)
                return self._shared(
                    self._memory, arrays, outputs, model, version, metadata, deadline
                )
            body, metadata = self._request(
                inputs, plain_values, outputs, request_id, no_cache, model, version
            )
            return prediction(self._call(body, metadata, deadline))
        except grpc.RpcError as exc:
            self._refused(exc, plain_values, model, version)
            self._raise(exc, self._routed_target())

    def _shared(
        self,
        memory: SharedMemory,
        arrays: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        model: str,
        version: str,
        metadata: Metadata,
        deadline: Deadline,
    ) -> Prediction:
        """AsyncSluiceClient._shared, blocking."""
        with memory.planned(arrays, outputs, model, version) as plan:
            try:
                return self._shared_send(memory, plan, metadata, deadline)
            except grpc.RpcError as exc:
                if not memory.failed(plan, exc):
                    raise
        with memory.planned(arrays, outputs, model, version) as plan:
            return self._shared_send(memory, plan, metadata, deadline)

    def _shared_send(
        self, memory: SharedMemory, plan: Layout, metadata: Metadata, deadline: Deadline
    ) -> Prediction:
        if plan.fresh:
            self._register(plan.arena, deadline)
        return shared_prediction(memory, plan, self._call(plan.body, metadata, deadline))

    def _register(self, arena: Arena, deadline: Deadline) -> None:
        """AsyncSluiceClient._register, blocking."""
        try:
            self._stub.UnregisterRegion(
                pb.UnregisterRegionRequest(name=arena.name),
                timeout=deadline.left(),
                metadata=self._auth,
            )
            self._stub.RegisterRegion(
                arena.registration(), timeout=deadline.left(), metadata=self._auth
            )
        except grpc.RpcError as exc:
            raise registration_error(exc, arena.name, self.target, self._hints) from exc
        arena.registered_now()

    def _call(self, body: bytes, metadata: Metadata, deadline: Deadline) -> Reply:
        """One Predict, traced when the application traces."""
        tracer = tracing.client_tracer()  # None unless the application traces
        if tracer is None:
            return self._calls(body, metadata, self._terms(deadline, body, metadata), self._send)
        with tracing.client_span(tracer, SPAN, metadata, self.targets, status_of) as (span, sent):
            reply = self._calls(body, sent, self._terms(deadline, body, sent), self._send)
            tracing.set_code(span, reply.code, reply.message, server=False)
        return reply

    def _calls(self, body: bytes, metadata: Metadata, terms: CallTerms, send: Step) -> Reply:
        """The call's attempts, each by `send` (`_send`: a Predict; `_ask`: a Metadata): one
        to the one target, or as the planner routes them."""
        if self._router is None:
            return send(self.target, body, metadata, terms.timeout)

        def attempt(backend: Backend, left: float | None) -> Reply:
            try:
                return send(backend.address, body, metadata, left)
            except grpc.RpcError as exc:
                return unary.failure(exc)  # for the planner to classify

        return self._router.run_sync(terms.key, terms.deadline, attempt, self._lock)

    def _send(self, target: str, body: bytes, metadata: Metadata, timeout: float | None) -> Reply:
        """One Predict to one target: the transport step. Raises grpc.RpcError."""
        return unary.call_sync(next(self._senders[target]), body, metadata, timeout)

    def _ask(self, target: str, body: bytes, metadata: Metadata, timeout: float | None) -> Reply:
        """One Metadata to one target: the transport step. Raises grpc.RpcError."""
        return unary.call_sync(self._askers[target], body, metadata, timeout)

    def health(self, *, model: str = "", timeout: float | None = None) -> pb.HealthResponse:
        """The first target's Health (a model's, when named)."""
        try:
            response: pb.HealthResponse = self._stub.Health(
                pb.HealthRequest(model=model), timeout=timeout or self.timeout, metadata=self._auth
            )
        except grpc.RpcError as exc:
            self._raise(exc, self.target)
        return response

    def metadata(
        self, *, model: str = "", version: str = "", timeout: float | None = None
    ) -> pb.MetadataResponse:
        """A model's metadata (the default one unless named), from a target that can answer
        (several: as the planner routes it, passing over one that is down)."""
        return self._metadata(model, version, self._deadline(timeout))

    def _metadata(
        self, model: str, version: str, deadline: Deadline, inputs: Inputs | None = None
    ) -> pb.MetadataResponse:
        """`inputs`: those of the plain call that needs it: unanswered, a value of theirs
        that no datatype could take is the caller's first thing to fix (`check_plain`)."""
        body = metadata_request(model, version)
        try:
            reply = self._calls(body, self._auth, self._terms(deadline), self._ask)
            return self._learned(model, version, reply)
        except grpc.RpcError as exc:
            if inputs is not None:
                check_plain(inputs)
            self._raise(exc, self._routed_target())

    def close(self) -> None:
        """Unregister this client's shared memory regions (if any), unlink their objects,
        and close its channels."""
        if self._memory is not None:
            for name in self._memory.registered():
                with contextlib.suppress(grpc.RpcError):  # a server gone forgot it anyway
                    self._stub.UnregisterRegion(
                        pb.UnregisterRegionRequest(name=name),
                        timeout=self.timeout,
                        metadata=self._auth,
                    )
            self._memory.close()
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
