"""The dataplane: one request path for every wire protocol and model. It owns the models, the
result cache and single-flight; a protocol hands it request bytes and its `WireProtocol`, and gets
back response bytes. Transport-free.

A cache hit is answered from the body's digest alone: nothing is parsed. The key covers the
protocol, the model's name and version and the body, so protocols never meet each other's
answers, nor a new model version an old one's. A request whose tensors lie in shared memory
regions (sluice.shm) is never cached: its answer depends on what the regions hold."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, NamedTuple, Protocol, TypeVar

import numpy as np
import xxhash

from sluice.core.errors import DeadlineExpired
from sluice.runtime import tracing
from sluice.server.dataplane.batcher import Arrays, Trip
from sluice.server.dataplane.cache import Entry, LRUCache, SingleFlight
from sluice.server.dataplane.models import Model, Models
from sluice.shm.registry import Lease

Opts = TypeVar("Opts")
Cached = Literal["hit", "miss"] | None  # None: the call kept out of the cache
HIT: Cached = "hit"
MISS: Cached = "miss"
EXPIRED = "the deadline passed before the model could run"
# With tracing: the span of a request's way from its decoded arrays to its encoded answer;
# its children are the steps (tracing.QUEUE_WAIT, tracing.BATCH_RUN, tracing.ENCODE).
MODEL_RUN = "sluice.model.run"


class Asked(NamedTuple):
    """Which model a request body asks for, read without decoding it (sluice.wire.facts).
    A tuple: made on every call, and a frozen dataclass costs twice as much."""

    model: str = ""  # empty: the default model
    version: str = ""  # empty: its newest ready version
    # Bytes of the body that do not change the answer (a per-call id): left out of the cache
    # key, and put in front of the answer, where they are the same field (KServe's `id`).
    echo: tuple[int, int] | None = None
    # The body may name shared memory regions (inputs read from, outputs written into one):
    # its answer is not the body's alone, so it is kept out of the cache and single-flight,
    # and decoded with the call's lease.
    shared: bool = False


@dataclass(slots=True)
class Request(Generic[Opts]):
    """A decoded request."""

    inputs: Mapping[str, np.ndarray]
    outputs: Sequence[str]  # empty: all of the model's outputs
    # The protocol's own, handed back to its `encode` (sluice.v1: typed outputs; with shared
    # memory, the views its outputs are written into, through the call's lease).
    options: Opts


class WireProtocol(Protocol[Opts]):
    """A wire protocol's request and response bodies. Raises InvalidInput on a bad body.
    `decode` is given the call's lease only when `route` said the body is `shared` (and the
    node takes shared memory); it reads inputs through it and takes the views its outputs
    go into, for `encode` to write (the dataplane releases the lease once it has)."""

    @property
    def name(self) -> str: ...  # in the cache key

    def route(self, body: bytes) -> Asked: ...

    def decode(self, body: bytes, lease: Lease | None = None) -> Request[Opts]: ...

    def encode(self, model: Model, request: Request[Opts], outputs: Arrays) -> bytes: ...


class Dataplane:
    def __init__(
        self, models: Models, cache: LRUCache, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.models = models
        self.cache = cache
        self.flight = SingleFlight()
        self.clock = clock  # deadlines are on this clock, and on the batchers'

    async def infer(
        self,
        body: bytes,
        protocol: WireProtocol[Opts],
        *,
        deadline: float | None = None,
        cache: bool = True,
        priority: int = 0,
        lease: Callable[[], Lease] | None = None,
    ) -> tuple[Entry, Cached]:
        """The answer to one request body, and whether the cache gave it (`cache=False`
        keeps the call out of the cache and single-flight, as does a body that names
        shared memory). A model run waits in the batcher's `priority` class (a computation
        shared by single-flight: its first caller's). `lease`: takes the call's hold on
        its caller's shared memory regions (None: the node takes none), asked only for a
        body that names regions, as its run begins; released once the answer is encoded."""
        if deadline is not None and deadline <= self.clock():
            raise DeadlineExpired(EXPIRED)
        asked = protocol.route(body)
        found = self.models.get(asked.model, asked.version)
        key = None
        if asked.shared or not cache or not self.cache.enabled:
            if tracing.ON:
                tracing.annotate(tracing.CACHE, "off")
        else:
            digest = xxhash.xxh3_128(protocol.name.encode())
            digest.update(found.scope)
            if asked.echo is None:
                digest.update(body)
            else:  # the body around the id, read in place: slices of bytes are copies
                view = memoryview(body)
                digest.update(view[: asked.echo[0]])
                digest.update(view[asked.echo[1] :])
            key = digest.digest()
        entry = None if key is None else self.cache.get(key)
        if entry is not None:
            if tracing.ON:
                tracing.annotate(tracing.CACHE, "hit")
            cached: Cached = HIT
        else:
            found.hold()  # a swap retires the model only once its calls are answered
            try:
                if key is None:
                    held = lease if asked.shared else None
                    entry = await self._answer(found, body, protocol, deadline, priority, held)
                    cached = None
                else:
                    compute = functools.partial(
                        self._answer, found, body, protocol, deadline, priority, key=key
                    )
                    retry = functools.partial(self._outlived, deadline)
                    entry, shared = await self.flight.run(key, compute, retry)
                    if tracing.ON:  # shared: another caller's computation answered
                        tracing.annotate(tracing.CACHE, "shared" if shared else "miss")
                    cached = HIT if shared else MISS
            finally:
                found.release()
        if asked.echo is not None:
            entry = Entry(body[asked.echo[0] : asked.echo[1]] + entry.body, entry.nonfinite)
        return entry, cached

    async def run(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] = (),
        *,
        deadline: float | None = None,
    ) -> tuple[Arrays, list[str]]:
        """For callers that hold arrays: run them uncached; the outputs and the inputs that
        held NaN or infinity."""
        if deadline is not None and deadline <= self.clock():
            raise DeadlineExpired(EXPIRED)
        found = self.models.get(model)
        found.hold()
        try:
            return await found.run(inputs, outputs, deadline)
        finally:
            found.release()

    def _outlived(self, deadline: float | None, exc: Exception) -> bool:
        """Whether a follower whose deadline is `deadline` tries again after the shared
        computation failed with `exc`: one that ran out of its leader's deadline, not its."""
        return isinstance(exc, DeadlineExpired) and (deadline is None or deadline > self.clock())

    async def _answer(
        self,
        model: Model,
        body: bytes,
        protocol: WireProtocol[Opts],
        deadline: float | None,
        priority: int,
        leases: Callable[[], Lease] | None = None,
        key: bytes | None = None,
    ) -> Entry:
        """Decode, run, encode; `leases` takes the call's hold on its regions, released once
        the answer is encoded (a failed call writes nothing back: its error stands). `key`:
        single-flight's shared computation, kept in the cache under it, which holds the model
        itself (its callers may all cancel and release theirs while it still runs)."""
        lease = None if leases is None else leases()
        run = None
        if key is not None:
            model.hold()
        try:
            request = protocol.decode(body, lease)  # a lease only for a body that names regions
            run = _RunSpans(model) if tracing.ON and tracing.recording() else None
            outputs, nonfinite = await model.run(
                request.inputs,
                request.outputs,
                deadline,
                None if run is None else run.trip,
                priority,
            )
            if run is not None:
                run.ran()
            encoded = protocol.encode(model, request, outputs)
        except BaseException as exc:
            if run is not None:
                run.ended(exc)
            if lease is not None:
                lease.release(ok=False)
            raise
        finally:
            if key is not None:
                model.release()
        if run is not None:
            run.ended()
        if lease is not None:  # the outputs land (a copy that cannot be written fails the call)
            lease.release()
        entry = Entry(encoded, tuple(nonfinite))
        if key is not None:
            self.cache.put(key, entry)
        return entry

    async def close(self) -> None:
        for model in self.models:
            await model.close()


class _RunSpans:
    """A model run with tracing on (the call sampled): its span, current from the run to the
    encoded answer, whose children are the steps: the queue wait and the batch run that the
    batcher tells `trip` of, then the encode."""

    __slots__ = ("_encode", "_model", "_run", "trip")

    def __init__(self, model: Model) -> None:
        attributes = {"sluice.model.name": model.name, "sluice.model.version": model.version}
        self._run = tracing.opened(MODEL_RUN, attributes)
        self._model = model
        self.trip = Trip()
        self._encode: tracing.Opened | None = None

    def ran(self) -> None:
        """The model ran: its steps, and the encode begins."""
        _steps(self.trip, self._model.batcher.clock)
        self._encode = tracing.opened(tracing.ENCODE)

    def ended(self, error: BaseException | None = None) -> None:
        if self._encode is None:  # the run failed: the steps it took
            _steps(self.trip, self._model.batcher.clock)
        else:
            self._encode.end(error)
        self._run.end(error)


def _steps(trip: Trip, clock: Callable[[], float]) -> None:
    """The queue wait and the batch run that the batcher told `trip` of, as spans under the
    current one; the batcher's clock (monotonic) is read against the wall clock now."""
    if trip.taken is None:
        return  # it never left the queue: refused at the door, or the caller gave up
    wall, now = time.time_ns(), clock()

    def ns(at: float) -> int:
        return wall - round((now - at) * 1e9)

    tracing.timed(tracing.QUEUE_WAIT, ns(trip.arrival), ns(trip.taken))
    if trip.requests:  # it ran (an expired request waited, then was dropped unrun)
        attributes: dict[str, str | int | float | bool] = {
            tracing.BATCH_ROWS: trip.rows,
            tracing.BATCH_REQUESTS: trip.requests,
            tracing.BATCH_REASON: trip.reason,
            tracing.BATCH_INLINE: trip.inline,
        }
        if trip.bucket is not None:  # padded inputs: the batch's length bucket
            attributes[tracing.BATCH_BUCKET] = trip.bucket
        tracing.timed(tracing.BATCH_RUN, ns(trip.started), ns(trip.ended), attributes)
