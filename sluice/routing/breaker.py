"""A per-backend circuit breaker as an explicit state machine. Transport-free; the clock and
random source are injected.

CLOSED lets calls through and counts consecutive backend failures; N of them open it.
OPEN refuses calls for a cooldown that doubles with each trip (with jitter), up to a cap.
HALF_OPEN then lets one probe through at a time; M successful probes in a row close it,
and a failed probe opens it again with a longer cooldown.

Outlier ejection (the pool's latency rule) opens it too, with `eject()`: the same OPEN and
HALF_OPEN, with a backoff of its own that doubles per ejection and is forgotten only when
the backend is judged fine again (`cleared()`), since a slow backend's probes succeed.

The owner may forbid opening (`failure(may_open=False)`, `eject()` not called): the pool
does so when its share of held-out backends is spent; the failures are still counted."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class State(Enum):
    CLOSED = "CLOSED"  # traffic flows
    OPEN = "OPEN"  # traffic refused until the cooldown ends
    HALF_OPEN = "HALF_OPEN"  # one probe at a time


@dataclass(frozen=True)
class BreakerSettings:
    failures_to_open: int = 5
    successes_to_close: int = 2
    base_cooldown_s: float = 0.5
    max_cooldown_s: float = 30.0
    jitter: float = 0.2  # cooldown x uniform(1 - jitter, 1 + jitter)


class Breaker:
    def __init__(
        self,
        settings: BreakerSettings = BreakerSettings(),
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.rng = rng or random.Random()
        self.state = State.CLOSED
        self.consecutive_failures = 0
        self.probe_successes = 0
        self.probing = False  # a HALF_OPEN probe is in flight
        self.trips = 0  # consecutive openings without closing: the backoff exponent
        self.ejections = 0  # outlier ejections since the backend was last judged fine
        self.open_until = 0.0

    def _refresh(self) -> None:
        if self.state is State.OPEN and self.clock() >= self.open_until:
            self.state = State.HALF_OPEN
            self.probe_successes = 0
            self.probing = False

    def available(self) -> bool:
        """Whether a call may go now (no side effects)."""
        self._refresh()
        if self.state is State.CLOSED:
            return True
        return self.state is State.HALF_OPEN and not self.probing

    @property
    def is_open(self) -> bool:
        """OPEN: out of the rotation until its cooldown ends."""
        self._refresh()
        return self.state is State.OPEN

    @property
    def held_out(self) -> bool:
        """OPEN or HALF_OPEN: out of the rotation, or on probation (one call at a time)."""
        self._refresh()
        return self.state is not State.CLOSED

    def acquire(self) -> bool:
        """Claim the right to send one call; in HALF_OPEN this takes the single probe slot."""
        if not self.available():
            return False
        if self.state is State.HALF_OPEN:
            self.probing = True
        return True

    def success(self) -> None:
        self._refresh()
        if self.state is State.HALF_OPEN:
            self.probing = False
            self.probe_successes += 1
            if self.probe_successes >= self.settings.successes_to_close:
                self.state = State.CLOSED
                self.trips = 0
                self.consecutive_failures = 0
        elif self.state is State.CLOSED:
            self.consecutive_failures = 0

    def failure(self, may_open: bool = True) -> None:
        """A backend failure. With `may_open` False it is counted but opens nothing (a failed
        probe only frees the probe slot): the owner's cap on held-out backends is spent."""
        self._refresh()
        if self.state is State.HALF_OPEN:
            if may_open:
                self._open()
            else:
                self.probing = False
        elif self.state is State.CLOSED:
            self.consecutive_failures += 1
            if may_open and self.consecutive_failures >= self.settings.failures_to_open:
                self._open()

    def eject(self) -> None:
        """Open for an outlier ejection: base cooldown x 2^(ejections so far), capped."""
        self._open(self.ejections)
        self.ejections += 1

    def cleared(self) -> None:
        """The backend was judged fine again: the next ejection starts from the base."""
        self.ejections = 0

    def release(self) -> None:
        """A claimed call ended without a verdict on the backend (the caller's own error)."""
        if self.state is State.HALF_OPEN:
            self.probing = False

    def _open(self, exponent: int | None = None) -> None:
        s = self.settings
        exponent = self.trips if exponent is None else exponent
        cooldown = min(s.max_cooldown_s, s.base_cooldown_s * 2 ** min(exponent, 64))
        cooldown *= self.rng.uniform(1 - s.jitter, 1 + s.jitter)
        self.state = State.OPEN
        self.open_until = self.clock() + cooldown
        self.trips += 1
        self.consecutive_failures = 0
        self.probing = False
