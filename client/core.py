"""The clients' sans-IO core: each call is a generator that builds its requests, yields the
I/O it needs (`Send`, `Unary`, `Explain`) and reads what comes back into a Prediction or an
exception; the drivers (sluice.client.aio, sluice.client.blocking) only perform the steps.
Tensors travel as raw little-endian bytes, plain values in the datatypes the model's metadata
declares. Several targets are servers balanced with the balancer's planner and its layers;
with `shared_memory`, sluice.shm.client places the tensors. Failures raise
grpc.RpcError, with sluice.client.diagnose's hint where grpc's words leave out what to fix.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, NoReturn, Self, TypedDict, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from sluice.client import diagnose
from sluice.core.keys import NO_CACHE_HEADER, NO_CACHE_VALUE, PREDICT, affinity_key
from sluice.core.tenants import authorization
from sluice.routing.breaker import BreakerSettings
from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import client as hedge
from sluice.routing.planner import Planner
from sluice.routing.pool import Pool
from sluice.runtime import tracing
from sluice.runtime.status import grpc_code
from sluice.runtime.tls import ClientTLS
from sluice.shm.client import SharedMemory, check_target
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
Sender = Callable[..., Any]  # a raw-bytes unary callable on one channel
SPAN = "sluice.client/Predict"  # with tracing (sluice.runtime.tracing): one per call
T = TypeVar("T")


@dataclass(frozen=True)
class Prediction:
    """A Predict answer: the outputs, the response metadata, and the model and version."""

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


class CallOptions(TypedDict, total=False):
    """predict's and infer's keywords (`Core._infer` says what each does)."""

    outputs: Sequence[str]
    timeout: float | None
    request_id: str | None
    no_cache: bool
    model: str
    version: str


def channel_options(
    max_message_bytes: int, extra: ChannelOptions, keepalive_s: float = 0.0
) -> list[tuple[str, Any]]:
    """The message limits, `keepalive` (keepalive_s 0: none), then the caller's `extra`."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *(keepalive(keepalive_s) if keepalive_s > 0 else ()),
        *extra,
    ]


def keepalive(keepalive_s: float) -> list[tuple[str, int]]:
    """Leave a target that stops answering (no RST) within a call's deadline: while calls are
    out, ping after PING_AFTER x keepalive_s silent and close on keepalive_s unanswered
    (UNAVAILABLE, which the planner retries); connects are bounded by keepalive_s too."""
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
    """As given (0: off), else KEEPALIVE_S with several targets and off with one (no other
    target to fail over to: the call's deadline bounds it)."""
    if keepalive_s is None:
        return KEEPALIVE_S if len(targets) > 1 else 0.0
    if keepalive_s < 0:
        raise ValueError(f"keepalive_s must be 0 (off) or more, not {keepalive_s}")
    return keepalive_s


def plain(inputs: Inputs) -> bool:
    """Whether some input is a plain value (not a numpy array): its datatype is the model's."""
    return any(not isinstance(value, np.ndarray) for value in inputs.values())


def check_plain(inputs: Inputs) -> None:
    """Refuse a plain value no datatype could take: without metadata, the first thing to fix."""
    for name, value in inputs.items():
        if not isinstance(value, np.ndarray):
            codec.array_of(name, value)


def declared(meta: pb.MetadataResponse) -> dict[str, str]:
    return {t.name: t.datatype for t in meta.model.inputs}


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
    code = exc.code() if isinstance(exc, grpc.RpcError) else None
    return code.value[0] if isinstance(code, grpc.StatusCode) else None


def target_list(target: str | Sequence[str]) -> list[str]:
    targets = [target] if isinstance(target, str) else list(target)
    if not targets:
        raise ValueError("give at least one target")
    return targets


def auth_metadata(api_key: str) -> Metadata:
    return (authorization(api_key),) if api_key else ()


def router(
    targets: Sequence[str],
    hedge_after_ms: float | str | None = None,
    breaker: BreakerSettings | None = None,
) -> Planner[Reply] | None:
    """The client's own balancing over several servers (None: one target), with its own
    pool, retry budget and layers."""
    hedging = hedge.option(hedge_after_ms, targets)  # ValueError before any channel opens
    servers = list(dict.fromkeys(targets))  # a target named twice is one server
    if len(servers) < 2:
        return None
    pool = Pool(breaker=breaker)
    pool.set_addresses(servers)
    return Planner(pool, RetryBudget(), Reply, hedging=hedging)


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
        """`left` for the last send: with nothing sent first, the timeout whole, no clock read."""
        return self.timeout if self.at is None else self.left()


@dataclass(frozen=True, slots=True)
class CallTerms:
    """One call's timeout, and with several targets its ring key and planner deadline."""

    timeout: float | None
    key: int | None
    deadline: float | None


@dataclass(frozen=True, slots=True)
class Send:
    """One Predict or Metadata: to the one target, or as the planner routes it."""

    predict: bool  # else a Metadata
    body: bytes
    metadata: Metadata
    terms: CallTerms


@dataclass(frozen=True, slots=True)
class Unary:
    """One stub call to the first target (Health, a registration)."""

    method: str
    request: Any
    timeout: float | None


@dataclass(frozen=True, slots=True)
class Explain:
    """The error to raise for `error`: diagnose's hint, which probes `target` (blocking)."""

    error: grpc.RpcError
    target: str


Step = Send | Unary | Explain
Steps = Generator[Step, Any, T]


class Exchange(Generic[T]):
    """A call's steps for a driver: iterating gives the next step once `answer` (or `error`)
    holds what performing the last one gave; `value` is the call's result."""

    __slots__ = ("_steps", "answer", "error", "value")

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self.answer: Any = None
        self.error: BaseException | None = None

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Step:
        error, self.error = self.error, None
        try:
            return self._steps.send(self.answer) if error is None else self._steps.throw(error)
        except StopIteration as stop:
            self.value: T = stop.value
            raise StopIteration from None


def prediction(reply: Reply) -> Prediction:
    """The answer a reply holds; a failed reply is raised as grpc raises a failed call."""
    if reply.code:
        raise rpc_error(reply)
    response = pb.PredictResponse.FromString(reply.body)
    return Prediction(
        codec.decode_all(response.outputs), reply.trailers, response.model, response.version
    )


class Core:
    """Both clients: targets, routing state, and each call as `Steps` (no I/O of its own).

    One target is a server or a balancer; several are servers this client balances. TLS
    when `tls` or a TLS option is given (`tls_ca`: CAs, else the system's; `tls_cert` and
    `tls_key`: mutual TLS; `server_name`: the name checked). `api_key` goes on every call.
    `hints`: whose options a failed call's hint names. `shared_memory`: tensors in POSIX
    regions this client registers (one target on this host, started --shared-memory).
    `hedge_after_ms` (several targets; ms or "auto"): sluice.routing.hedge.client's option.
    `keepalive_s` (None: 0.3 with several targets, else off): a silent target fails its calls
    UNAVAILABLE for a retry elsewhere."""

    _owned = True  # close() closes the channels
    _memory: SharedMemory | None = None

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
        routed = router(targets, hedge_after_ms)
        security = ClientTLS.of(
            tls=tls, ca=tls_ca, cert=tls_cert, key=tls_key, server_name=server_name
        )
        settings = channel_options(max_message_bytes, options, keepalive_of(keepalive_s, targets))
        channels = {t: [self._open(t, security, settings)] for t in targets}
        shown = diagnose.Shown(tls=security is not None, certificate=bool(tls_cert))
        self._attach(channels, timeout, api_key, shown, hints, routed)
        self._memory = SharedMemory() if shared_memory else None

    @classmethod
    def on_channels(
        cls,
        channels: Mapping[str, Sequence[Any]],
        *,
        timeout: float | None = 10.0,
        api_key: str = "",
        hedge_after_ms: float | str | None = None,
    ) -> Self:
        """A client over channels the caller made and closes, several per target if it likes
        (used in turn); for the load generator's connection counts."""
        client = cls.__new__(cls)
        routed = router(list(channels), hedge_after_ms)
        client._attach(channels, timeout, api_key, None, diagnose.Audience.PYTHON, routed)
        client._owned = False
        return client

    def _open(self, target: str, security: ClientTLS | None, settings: ChannelOptions) -> Any:
        raise NotImplementedError  # each driver opens its own kind of channel

    def _attach(
        self,
        channels: Mapping[str, Sequence[Any]],
        timeout: float | None,
        api_key: str,
        shown: diagnose.Shown | None,  # None: channels the caller made, their TLS unknown
        hints: diagnose.Audience,
        routed: Planner[Reply] | None,
    ) -> None:
        self._channels = {t: list(chs) for t, chs in channels.items()}
        self.targets = target_list(list(channels))
        self.target = self.targets[0]
        self.timeout = timeout
        self._shown, self._hints = shown, hints
        self._auth = auth_metadata(api_key)
        # The inputs' datatypes by (model, version), asked once, for plain values only.
        self._declared: dict[tuple[str, str], dict[str, str]] = {}
        self._senders: dict[str, Iterator[Sender]] = {
            t: itertools.cycle([ch.unary_unary(PREDICT, **RAW) for ch in chs])
            for t, chs in channels.items()
        }
        self._askers: dict[str, Sender] = {
            t: chs[0].unary_unary(METADATA, **RAW) for t, chs in channels.items()
        }
        self._router = routed
        # The one clock of calls' deadlines (the planner's).
        self._clock = time.monotonic if self._router is None else self._router.clock
        self._stub = pb_grpc.InferenceStub(self._channels[self.target][0])
        self._lock = threading.Lock()  # the planner's steps, when threads share a client

    def _method(self, predict: bool, target: str) -> Sender:
        """The target's raw callable (its Predict channels used in turn)."""
        return next(self._senders[target]) if predict else self._askers[target]

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(timeout or self.timeout, self._clock)

    def _infer(
        self,
        inputs: Inputs,
        *,
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        request_id: str | None = None,
        no_cache: bool = False,
        model: str = "",
        version: str = "",
    ) -> Steps[Prediction]:
        """Run the model (empty `model`, `version`: the default one, its newest version) for
        `outputs` (empty: all). `no_cache` keeps the call out of the result cache and of
        cache-affinity routing. A plain call asks the datatypes first, within `timeout`."""
        deadline = self._deadline(timeout)
        plain_values = plain(inputs)
        if plain_values and (model, version) not in self._declared:
            yield from self._metadata(model, version, deadline, inputs)
        metadata = (*call_metadata(request_id, no_cache).items(), *self._auth)
        datatypes = self._declared.get((model, version)) if plain_values else None
        try:
            if self._memory is not None:
                arrays = {
                    n: codec.array_of(n, v, (datatypes or {}).get(n, "")) for n, v in inputs.items()
                }
                reply, response, values = yield from self._memory.call(
                    arrays,
                    outputs,
                    model,
                    version,
                    partial(self._answered, metadata, deadline),
                    partial(self._stub_call, deadline),
                    (self.target, self._hints),
                )
                return Prediction(values, reply.trailers, response.model, response.version)
            body = codec.encode_predict(inputs, outputs, model, version, datatypes)
            return prediction((yield from self._call(body, metadata, deadline)))
        except grpc.RpcError as exc:
            # A swap may have changed the datatypes: the next plain call asks again.
            if plain_values and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                self._declared.pop((model, version), None)
            return (yield from self._raise(exc, self._routed_target()))

    def _answered(self, metadata: Metadata, deadline: Deadline, body: bytes) -> Steps[Reply]:
        """One Predict's reply; a failed one raised as grpc raises a failed call."""
        reply = yield from self._call(body, metadata, deadline)
        if reply.code:
            raise rpc_error(reply)
        return reply

    def _stub_call(self, deadline: Deadline | None, method: str, request: Any) -> Steps[Any]:
        """One stub call to the first target within `deadline` (None: the client's timeout)."""
        return (yield Unary(method, request, self.timeout if deadline is None else deadline.left()))

    def _call(self, body: bytes, metadata: Metadata, deadline: Deadline) -> Steps[Reply]:
        """One Predict, traced when the application traces."""
        tracer = tracing.client_tracer()  # None unless the application traces
        if tracer is None:
            reply: Reply = yield Send(True, body, metadata, self._terms(deadline, body, metadata))
            return reply
        with tracing.client_span(tracer, SPAN, metadata, self.targets, status_of) as (span, sent):
            reply = yield Send(True, body, sent, self._terms(deadline, body, sent))
            tracing.set_code(span, reply.code, reply.message, server=False)
        return reply

    def _raw(
        self, body: bytes, metadata: Mapping[str, str] | None, timeout: float | None
    ) -> Steps[Reply]:
        sent = (*(metadata or {}).items(), *self._auth)
        try:
            return (yield from self._call(body, sent, self._deadline(timeout)))
        except grpc.RpcError as exc:
            return unary.failure(exc)

    def _metadata(
        self, model: str, version: str, deadline: Deadline, inputs: Inputs | None = None
    ) -> Steps[pb.MetadataResponse]:
        """`inputs`: the plain call's that needs it, whose unusable values fail first."""
        body = pb.MetadataRequest(model=model, version=version).SerializeToString()
        try:
            reply: Reply = yield Send(False, body, self._auth, self._terms(deadline))
            if reply.code:
                raise rpc_error(reply)
            meta = pb.MetadataResponse.FromString(reply.body)
            self._declared[model, version] = declared(meta)
            return meta
        except grpc.RpcError as exc:
            if inputs is not None:
                check_plain(inputs)
            return (yield from self._raise(exc, self._routed_target()))

    def _health(self, model: str, timeout: float | None) -> Steps[pb.HealthResponse]:
        try:
            response: pb.HealthResponse = yield Unary(
                "Health", pb.HealthRequest(model=model), timeout or self.timeout
            )
        except grpc.RpcError as exc:
            return (yield from self._raise(exc, self.target))
        return response

    def _unregister_all(self) -> Steps[None]:
        """What close() sends first."""
        if self._memory is not None:
            yield from self._memory.unregister_all(partial(self._stub_call, None))

    def _terms(
        self, deadline: Deadline, body: bytes | None = None, metadata: Metadata = ()
    ) -> CallTerms:
        """Straight to the one target, or through the planner (a Predict `body` routes by its
        ring key, other calls to the least loaded)."""
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

    def _raise(self, error: grpc.RpcError, target: str) -> Generator[Step, Any, NoReturn]:
        """Raise `error`, or diagnose's hint of what to fix (a probe is an `Explain` step)."""
        step = Explain(error, target)
        probes = diagnose.needs_probe(error, target, self._shown)
        explained = (yield step) if probes else self._explained(step)
        if explained is error:
            raise error
        raise explained from error

    def _explained(self, step: Explain) -> BaseException:
        return diagnose.explained(step.error, step.target, self._shown, self._hints)
