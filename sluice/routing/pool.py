"""The backends and the routing decision. Transport-free: the clock and random source are
injected, and a backend's connection is whatever object the transport hangs on it.

A call with an affinity key goes to the key's owner on the ring, or, when the owner is out
or over its bounded load, to the next backend on the ring; a call without one goes to the
cheaper of two random backends by its `Cost`: (in flight + 1) x its peak-EWMA latency, unless
a layer above injects another (which may also have keyed calls pass over some). A backend is
out while its health watch says it is not serving or its breaker refuses calls.

A backend is held out by its health watch (never capped: the server's own word) or by its
breaker (failures, its own timeouts, latency outliers), at most `max_ejection_percent` of the
live ones at once, beyond which every breaker is overruled (docs/DESIGN.md).

Backends may serve different models: a call wants one (`Want`) and goes only to those that
serve it, each model with its own ring; one whose models are not learned yet may take any."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sluice.core.errors import Code
from sluice.routing.breaker import Breaker, BreakerSettings, State
from sluice.routing.p2c import PeakEwma, p2c
from sluice.routing.ring import MaglevRing, pick_bounded


class Health:
    UNKNOWN = "UNKNOWN"  # not heard from yet: given the benefit of the doubt
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"  # draining, down or hung: no new calls


@dataclass(eq=False)
class Backend:
    address: str
    breaker: Breaker
    latency: PeakEwma
    health: str = Health.UNKNOWN
    in_flight: int = 0
    calls: int = 0
    failures: int = 0
    timeouts: int = 0  # timeouts counted against it (OutlierSettings)
    transport: Any = None  # set by the transport layer
    # Model name -> its ready versions, newest first, as the server last said (Pool.learn);
    # None: not learned yet. `default`: what a call naming no model gets there ('' none).
    models: dict[str, tuple[str, ...]] | None = None
    default: str = ""
    # Why its transport holds it out (it refuses connections, does not answer, ...), for
    # the message when none is usable; "" while it serves or when the server said so.
    down: str = ""
    # Attempts sent and not answered, those given up on (cancelled, timed out) included
    # until it answers anything, and when the oldest of them was sent (at most: once it
    # answers, the time of that answer).
    owed: int = 0
    owed_since: float = 0.0

    @property
    def usable(self) -> bool:
        return self.health != Health.NOT_SERVING and self.breaker.available()


@dataclass(frozen=True)
class OutlierSettings:
    """Slow is a failure too (Envoy's outlier detection, by latency). `factor` <= 0 turns
    both rules off.

    - A timeout (verdict 'slow') counts as a backend failure for its breaker when the call
      had at least max(`min_latency_s`, `factor` x the median mean latency of the other
      backends); with no others to compare with it does not count. A caller whose deadline
      is shorter than what backends usually need does not make them look bad, and any
      answered call in between breaks the streak.
    - Every `interval_s`, a backend with at least `min_calls` answered calls (its mean is
      over about its last `min_calls`; ejection starts it afresh), whose mean latency is
      above max(`min_latency_s`, `factor` x
      the median of the others' (those with `min_calls` too)), is ejected: its breaker
      opens with a backoff that doubles per ejection, until a later look finds it fine."""

    factor: float = 3.0
    min_calls: int = 20
    min_latency_s: float = 0.02
    interval_s: float = 0.25


@dataclass(frozen=True, slots=True)
class Want:
    """What a call asks for: a model ('' the default model) and a version ('' any)."""

    model: str = ""
    version: str = ""

    def __str__(self) -> str:
        named = f"model {self.model!r}"
        return f"{named} version {self.version!r}" if self.version else named


ANY = Want()


@dataclass(frozen=True)
class Choice:
    backend: Backend | None
    why: str = ""  # when there is no backend: why, for the message
    # When there is no backend: UNAVAILABLE (those that serve the call are out), NOT_FOUND
    # (no backend serves it) or INVALID_ARGUMENT (the call cannot be routed as it is).
    code: int = Code.UNAVAILABLE


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the calls for one Want may go (the backends that hold it, the model's ring, or
    why none can), while the pool's generation holds."""

    generation: int
    holders: list[Backend]  # the backends that serve it, or may (not learned yet)
    ring: MaglevRing  # over the backends that serve the model, any version
    refusal: Choice | None = None  # no backend can serve it: the answer


# Routes kept at most: callers name models, and names nobody serves must not grow memory;
# a longer name than any model has is refused, and a refusal is not kept.
MAX_ROUTES = 1024
MAX_NAME = 256


class Cost:
    """What least-loaded choice weighs a backend by, and whether keyed calls pass over it
    (`passes_over` says whether any may be): the pool's seam for a layer above."""

    passes_over = False

    def __call__(self, backend: Backend) -> float:
        return (backend.in_flight + 1) * backend.latency.current()

    def shunned(self, backend: Backend) -> bool:
        return False


class Pool:
    def __init__(
        self,
        *,
        breaker: BreakerSettings | None = None,
        balance_factor: float = 1.25,
        ewma_decay_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        table_size: int | None = None,
        max_ejection_percent: float = 50.0,
        outlier: OutlierSettings | None = None,
        probe_after_s: float = 0.05,
        cost: Cost | None = None,
    ) -> None:
        if not 0 <= max_ejection_percent <= 100:
            raise ValueError("max_ejection_percent must be between 0 and 100")
        self.breaker_settings = breaker or BreakerSettings()
        self.max_ejection_percent = max_ejection_percent
        self.outlier = outlier or OutlierSettings()
        # With nothing in flight, what a backend owes is forgiven after this long.
        self.probe_after_s = probe_after_s
        self.cost = cost or Cost()
        self.ejections = 0  # latency outlier ejections so far
        self._next_look = 0.0
        self.balance_factor = balance_factor
        self.ewma_decay_s = ewma_decay_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.table_size = table_size
        self.backends: dict[str, Backend] = {}
        self.ring = MaglevRing([])  # over every backend: calls when no model is learned
        self.calls = 0
        # Bumped whenever the backends or what they serve change: the routes are then stale.
        self._generation = 0
        self._routes: dict[Want, Placement] = {}
        # Rings by their backends: models served by the same backends share one. Those not
        # used since the last change are dropped at the next (`_changed`).
        self._rings: dict[frozenset[str], MaglevRing] = {}
        self._retired: dict[frozenset[str], MaglevRing] = {}

    def set_addresses(self, addresses: Iterable[str]) -> tuple[list[Backend], list[Backend]]:
        """Make the pool hold exactly these backends; returns (added, removed)."""
        wanted = list(dict.fromkeys(addresses))
        removed = [b for a, b in self.backends.items() if a not in wanted]
        added = []
        for address in wanted:
            if address not in self.backends:
                backend = Backend(
                    address,
                    Breaker(self.breaker_settings, self.clock, self.rng),
                    PeakEwma(self.ewma_decay_s, clock=self.clock, window=self.outlier.min_calls),
                )
                self.backends[address] = backend
                added.append(backend)
        for backend in removed:
            del self.backends[backend.address]
        if added or removed:
            self.ring = self._ring(frozenset(self.backends))
            self._changed()
        return added, removed

    def learn(
        self, backend: Backend, models: dict[str, tuple[str, ...]] | None, default: str = ""
    ) -> bool:
        """What `backend` serves now (None: unknown again); True when that changed."""
        if backend.models == models and backend.default == default:
            return False
        backend.models, backend.default = models, default
        if self.backends.get(backend.address) is backend:
            self._changed()
        return True

    def _changed(self) -> None:
        self._generation += 1
        self._routes.clear()
        self._retired, self._rings = self._rings, {frozenset(self.ring.nodes): self.ring}

    def _ring(self, members: frozenset[str]) -> MaglevRing:
        ring = self._rings.get(members) or self._retired.get(members)
        if ring is None:
            kwargs = {"table_size": self.table_size} if self.table_size else {}
            ring = MaglevRing(members, **kwargs)
        self._rings[members] = ring
        return ring

    def default_model(self) -> str | Choice:
        """The one default model of the backends that report one ('' when none does), or
        the refusal of calls naming no model when they disagree."""
        defaults: dict[str, list[str]] = {}
        for b in self.backends.values():
            if b.models is not None and b.default:
                defaults.setdefault(b.default, []).append(b.address)
        if len(defaults) <= 1:
            return next(iter(defaults), "")
        named = "; ".join(f"{m!r} on {', '.join(a)}" for m, a in sorted(defaults.items()))
        return Choice(
            None,
            f"the servers behind this balancer have different default models ({named}): "
            "name a model",
            Code.INVALID_ARGUMENT,
        )

    def route(self, want: Want) -> Placement:
        """The backends that may take calls for `want`, and its ring (cached per generation)."""
        found = self._routes.get(want)
        if found is not None and found.generation == self._generation:
            return found
        if len(want.model) > MAX_NAME or len(want.version) > MAX_NAME:
            why = f"a model name or version longer than {MAX_NAME} characters"
            return Placement(
                self._generation, [], self.ring, Choice(None, why, Code.INVALID_ARGUMENT)
            )
        found = self._route(want)
        if found.refusal is None:
            if len(self._routes) >= MAX_ROUTES:
                self._routes.clear()
            self._routes[want] = found
        return found

    def _route(self, want: Want) -> Placement:
        backends = list(self.backends.values())
        if not any(b.models is not None for b in backends):  # nothing learned: all may
            return Placement(self._generation, backends, self.ring)
        model, default = want.model, not want.model
        if default:
            resolved = self.default_model()
            if isinstance(resolved, Choice):
                return Placement(self._generation, [], self.ring, resolved)
            model = resolved
        # A backend serves a call naming no model only if that is its own default too.
        serving = [
            b
            for b in backends
            if b.models is None
            or (model and model in b.models and (not default or b.default == model))
        ]
        holders = [
            b
            for b in serving
            if not want.version or b.models is None or want.version in b.models[model]
        ]
        ring = self._ring(frozenset(b.address for b in serving))
        if holders:
            return Placement(self._generation, holders, ring)
        if not model:
            what = "a default model"
        else:
            what = str(Want(model, want.version))
            what = what if want.model else f"the default model, {what}"
        served = sorted({m for b in backends for m in b.models or ()})
        why = f"no server behind this balancer serves {what}" + (
            f" (they serve {', '.join(map(repr, served))})" if served else ""
        )
        return Placement(self._generation, [], ring, Choice(None, why, Code.NOT_FOUND))

    def choose(self, key: int | None, exclude: Iterable[Backend] = (), want: Want = ANY) -> Choice:
        route = self.route(want)
        if route.refusal is not None:
            return route.refusal
        skip = set(map(id, exclude))
        candidates = [b for b in route.holders if id(b) not in skip]
        usable = [b for b in candidates if b.usable]
        if len(usable) < len(candidates) and self.panicking():  # only when some are out
            usable = [b for b in candidates if b.health != Health.NOT_SERVING]
        if not usable:
            return Choice(None, self._why_none(candidates))
        if key is None:
            chosen = p2c(usable, self.cost, self.rng)
        else:
            cost = self.cost
            fresh = [b for b in usable if not cost.shunned(b)] if cost.passes_over else usable
            by_address = {b.address: b for b in fresh or usable}
            address = pick_bounded(
                route.ring,
                key,
                list(by_address),
                lambda a: self.backends[a].in_flight,
                self.balance_factor,
            )
            chosen = by_address[address] if address else None
        return Choice(chosen)

    def spread(self, want: Want, count: int) -> list[int | None]:
        """Ring keys that start `count` parts of one call (fan-out's chunks) on distinct
        backends, the least loaded first (in turn, when there are more parts than backends).
        Two random choices put 4 parts on 4 idle servers only 5 times in 12 (measured: 7 in
        16), and such a call waits for its slowest server. Bounded loads still move a part
        off a backend other calls keep busy; a retry goes on along the key's ring order.
        None (two random choices) for each part when no backend can take the model now:
        `choose` says why."""
        route = self.route(want)
        usable = [b for b in route.holders if b.usable]
        if route.refusal is not None or not usable:
            return [None] * count
        order = sorted(usable, key=self.cost)
        wanted = {b.address for b in order[:count]}
        first: dict[str, int] = {}  # each wanted backend's first slot on the ring: its key
        for key in range(route.ring.size):
            owner = route.ring.owner(key)
            if owner in wanted:
                first.setdefault(owner, key)
                if len(first) == len(wanted):
                    break
        keys = [first[b.address] for b in order if b.address in first]
        return [keys[i % len(keys)] for i in range(count)]

    def _why_none(self, candidates: list[Backend]) -> str:
        if not self.backends:
            return "no backends are configured"
        if not candidates:
            return "every backend was tried"
        states = ", ".join(
            f"{b.address} {b.down or b.health.lower()}"
            + (f" breaker {b.breaker.state.value}" if b.breaker.state is not State.CLOSED else "")
            for b in candidates
        )
        return f"none is usable ({states})"

    def ejection_cap(self) -> int:
        """How many live backends (not NOT_SERVING) breakers and ejections may hold out at
        once: floor(max_ejection_percent % of them)."""
        live = sum(b.health != Health.NOT_SERVING for b in self.backends.values())
        return math.floor(self.max_ejection_percent * live / 100 + 1e-9)

    def held_out(self) -> int:
        """Live backends whose breaker is OPEN. One on HALF_OPEN probation takes calls again
        and does not count: a latency ejection on probation must not keep a backend that
        fails every call from opening."""
        return sum(
            b.health != Health.NOT_SERVING and b.breaker.is_open for b in self.backends.values()
        )

    def may_hold_out(self, backend: Backend) -> bool:
        """Whether `backend`'s breaker may open now without breaking the cap. A backend
        that is not live is not counted (its health watch holds it out anyway)."""
        if backend.health == Health.NOT_SERVING:
            return True
        held = self.held_out() + (not backend.breaker.is_open)
        return held <= self.ejection_cap()

    def panicking(self) -> bool:
        """Whether breakers refuse more live backends than the cap allows (possible only
        when the live set changed under open breakers): then every breaker is overruled, so
        no run of failures, whoever caused it, can make the pool refuse every call. A
        backend whose health watch says NOT_SERVING stays out regardless."""
        live = 0
        refused = 0
        for backend in self.backends.values():
            if backend.health != Health.NOT_SERVING:
                live += 1
                refused += not backend.breaker.available()
        return refused > math.floor(self.max_ejection_percent * live / 100 + 1e-9)

    def start(self, backend: Backend) -> bool:
        """Claim a call on `backend`; False when its breaker refuses (a probe is out) and
        the pool is not panicking."""
        if not backend.breaker.acquire() and not self.panicking():
            return False
        now = self.clock()
        if not backend.in_flight and (
            not backend.owed or now - backend.owed_since > self.probe_after_s
        ):
            backend.owed, backend.owed_since = 0, now  # nothing owed, or forgiven
        backend.owed += 1
        backend.in_flight += 1
        backend.calls += 1
        self.calls += 1
        return True

    def finish(self, backend: Backend, seconds: float, verdict: str, answered: bool = True) -> None:
        """`verdict`: 'ok' (the backend answered), 'failed' (the backend failed), 'slow' (it
        did not answer in time: its latency counts, and when the call had long enough by
        `OutlierSettings` the timeout is a failure for its breaker) or 'neutral' (no
        verdict on the backend, e.g. the caller cancelled). `answered`: the backend said
        something (False: the attempt timed out, broke or was cancelled, and stays owed)."""
        backend.in_flight -= 1
        if answered:
            backend.owed, backend.owed_since = backend.in_flight, self.clock()
        if verdict == "ok":
            backend.latency.observe(seconds)
            if self._slow_probe(backend, seconds) and self.may_hold_out(backend):
                backend.breaker.eject()  # still an outlier: out again, for twice as long
                backend.latency.reset_mean()  # judged anew on the calls after it returns
                self.ejections += 1
            else:
                backend.breaker.success()
        elif verdict == "failed":
            backend.failures += 1
            backend.breaker.failure(self.may_hold_out(backend))
            backend.latency.fail()
        elif verdict == "slow":
            backend.latency.observe(seconds)
            if self._own_timeout(backend, seconds):
                backend.timeouts += 1
                backend.breaker.failure(self.may_hold_out(backend))
            else:
                backend.breaker.release()
        else:
            backend.breaker.release()
        if verdict != "neutral" and self.outlier.factor > 0:
            now = self.clock()
            if now >= self._next_look:
                self._next_look = now + self.outlier.interval_s
                self.eject_outliers()

    def withdraw(self, backend: Backend) -> None:
        """A call `start` claimed that its transport never sent (refused on this side): as if
        it had not been claimed. The balancer's transport refuses without yielding to the
        event loop, so nothing reads the counts between the claim and this."""
        backend.in_flight -= 1
        backend.owed -= 1
        backend.calls -= 1
        self.calls -= 1
        backend.breaker.release()

    def unreachable(self, backend: Backend) -> None:
        """The backend could not be reached outside a call (its health watch broke)."""
        backend.failures += 1
        backend.breaker.failure(self.may_hold_out(backend))
        backend.latency.fail()

    def serving(self) -> bool:
        return any(b.usable for b in self.backends.values()) or self.panicking()

    def _reference(self, backend: Backend) -> float | None:
        """The median mean latency of the other live backends with enough calls, if any."""
        enough = self.outlier.min_calls
        means = [
            b.latency.mean
            for b in self.backends.values()
            if b is not backend and b.health != Health.NOT_SERVING and b.latency.samples >= enough
        ]
        return statistics.median(means) if means else None

    def _slow_probe(self, backend: Backend, seconds: float) -> bool:
        """Whether a probe of a backend ejected as a latency outlier answered as slowly as
        one: a slow answer is no proof of health (else some `min_calls` slow calls follow
        each cooldown before it is judged again)."""
        rules = self.outlier
        breaker = backend.breaker
        if rules.factor <= 0 or not breaker.ejections or breaker.state is not State.HALF_OPEN:
            return False
        reference = self._reference(backend)
        return reference is not None and seconds > max(
            rules.min_latency_s, rules.factor * reference
        )

    def _own_timeout(self, backend: Backend, seconds: float) -> bool:
        """Whether a call that ran out of time after `seconds` is the backend's fault."""
        rules = self.outlier
        if rules.factor <= 0:
            return False
        reference = self._reference(backend)
        if reference is None:  # nothing to compare with (start-up, one or two backends)
            return False
        return seconds >= max(rules.min_latency_s, rules.factor * reference)

    def eject_outliers(self) -> list[Backend]:
        """Eject the latency outliers among the live backends in rotation (within the cap);
        clear the record of those judged fine. Returns the ones ejected."""
        rules = self.outlier
        ejected = []
        for backend in self.backends.values():
            latency = backend.latency
            if (
                backend.health == Health.NOT_SERVING
                or backend.breaker.held_out
                or latency.samples < rules.min_calls
            ):
                continue
            reference = self._reference(backend)
            if reference is None:
                continue
            if latency.mean <= max(rules.min_latency_s, rules.factor * reference):
                backend.breaker.cleared()
            elif self.may_hold_out(backend):
                backend.breaker.eject()
                latency.reset_mean()  # judged anew on the calls after it returns
                self.ejections += 1
                ejected.append(backend)
        return ejected
