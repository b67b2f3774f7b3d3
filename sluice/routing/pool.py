"""The backends and the routing decision. Transport-free: the clock and random source are
injected, and a backend's connection is whatever object the transport hangs on it.

A call with an affinity key goes to the key's owner on the ring, or, when the owner is out
or over its bounded load, to the next backend on the ring; a call without one goes to the
cheaper of two random backends (in-flight x peak-EWMA latency). A backend is out while its
health watch says it is not serving or its breaker refuses calls."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sluice.routing.breaker import Breaker, BreakerSettings, State
from sluice.routing.p2c import PeakEwma, p2c
from sluice.routing.ring import MaglevRing, pick_bounded


class Health:
    UNKNOWN = "UNKNOWN"  # not heard from yet: given the benefit of the doubt
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"  # draining or down: no new calls


@dataclass(eq=False)
class Backend:
    address: str
    breaker: Breaker
    latency: PeakEwma
    health: str = Health.UNKNOWN
    in_flight: int = 0
    calls: int = 0
    failures: int = 0
    transport: Any = None  # set by the transport layer

    @property
    def usable(self) -> bool:
        return self.health != Health.NOT_SERVING and self.breaker.available()


@dataclass(frozen=True)
class Choice:
    backend: Backend | None
    why: str = ""  # when there is no backend: why, for the UNAVAILABLE message


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
        panic_threshold: float = 0.5,
    ) -> None:
        self.breaker_settings = breaker or BreakerSettings()
        self.panic_threshold = panic_threshold
        self.balance_factor = balance_factor
        self.ewma_decay_s = ewma_decay_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.table_size = table_size
        self.backends: dict[str, Backend] = {}
        self.ring = MaglevRing([])
        self.calls = 0

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
                    PeakEwma(self.ewma_decay_s, clock=self.clock),
                )
                self.backends[address] = backend
                added.append(backend)
        for backend in removed:
            del self.backends[backend.address]
        if added or removed:
            kwargs = {"table_size": self.table_size} if self.table_size else {}
            self.ring = MaglevRing(self.backends, **kwargs)
        return added, removed

    def choose(self, key: int | None, exclude: Iterable[Backend] = ()) -> Choice:
        skip = set(map(id, exclude))
        candidates = [b for b in self.backends.values() if id(b) not in skip]
        usable = [b for b in candidates if b.usable]
        if len(usable) < len(candidates) and self.panicking():  # only when some are out
            usable = [b for b in candidates if b.health != Health.NOT_SERVING]
        if not usable:
            return Choice(None, self._why_none(candidates))
        if key is None:
            chosen = p2c(usable, self._cost, self.rng)
        else:
            by_address = {b.address: b for b in usable}
            address = pick_bounded(
                self.ring,
                key,
                list(by_address),
                lambda a: self.backends[a].in_flight,
                self.balance_factor,
            )
            chosen = by_address[address] if address else None
        return Choice(chosen)

    def _cost(self, backend: Backend) -> float:
        return (backend.in_flight + 1) * backend.latency.current()

    def _why_none(self, candidates: list[Backend]) -> str:
        if not self.backends:
            return "no backends are configured"
        if not candidates:
            return "every backend was tried"
        states = ", ".join(
            f"{b.address} {b.health.lower()}"
            + (f" breaker {b.breaker.state.value}" if b.breaker.state is not State.CLOSED else "")
            for b in candidates
        )
        return f"none is usable ({states})"

    def panicking(self) -> bool:
        """Whether breakers hold out so many of the backends that report SERVING that fewer
        than `panic_threshold` of them are left: then the breakers are overruled (Envoy's
        panic threshold), so no run of failures, whoever caused it, can make the pool refuse
        every call. A backend whose health watch says NOT_SERVING stays out regardless."""
        live = 0
        usable = 0
        for backend in self.backends.values():
            if backend.health != Health.NOT_SERVING:
                live += 1
                usable += backend.breaker.available()
        return usable < self.panic_threshold * live

    def start(self, backend: Backend) -> bool:
        """Claim a call on `backend`; False when its breaker refuses (a probe is out) and
        the pool is not panicking."""
        if not backend.breaker.acquire() and not self.panicking():
            return False
        backend.in_flight += 1
        backend.calls += 1
        self.calls += 1
        return True

    def finish(self, backend: Backend, seconds: float, verdict: str) -> None:
        """`verdict`: 'ok' (the backend answered), 'failed' (the backend failed), 'slow' (it
        did not answer in time: its latency counts, its breaker is not told) or 'neutral'
        (no verdict on the backend, e.g. the caller cancelled)."""
        backend.in_flight -= 1
        if verdict == "ok":
            backend.breaker.success()
            backend.latency.observe(seconds)
        elif verdict == "failed":
            backend.failures += 1
            backend.breaker.failure()
            backend.latency.fail()
        else:
            if verdict == "slow":
                backend.latency.observe(seconds)
            backend.breaker.release()

    def unreachable(self, backend: Backend) -> None:
        """The backend could not be reached outside a call (its health watch broke)."""
        backend.failures += 1
        backend.breaker.failure()
        backend.latency.fail()

    def serving(self) -> bool:
        return any(b.usable for b in self.backends.values()) or self.panicking()
