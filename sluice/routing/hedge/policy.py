"""Hedging's policy: its settings, its delay (fixed, or `auto` from each backend's recent
answers), its own budget and its counts, and how it plugs into a planner (`install`: the
silence rule as the pool's cost, the answers' latencies as the auto delay's samples, and
its loops around the planner's, as tower's hedge wraps a service; `race`: a call's hedged
driver state). Transport-free: the clock, the sleep and the wait are injected.
docs/DESIGN.md says why the delay and the budget are what they are."""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from sluice.routing.budget import RetryBudget
from sluice.routing.hedge.race import Race, hedged, hedged_sync
from sluice.routing.hedge.silence import Silence
from sluice.routing.plan import NO_LOCK, Plan, R
from sluice.routing.pool import Cost

if TYPE_CHECKING:
    from sluice.routing.planner import Drive, DriveSync, Planner, Send, SendSync, Start

AUTO = "auto"
WINDOW = 128  # a backend's answered attempts its tail is of
MIN_SAMPLES = 20  # a backend's answered attempts before its tail counts
REFRESH = 16  # the auto delay is worked out again every this many samples
BANK = 10.0  # hedges the budget may hold
MAX_BACKENDS = 1024  # windows kept at most (addresses come and go with discovery)


@dataclass(frozen=True)
class HedgeSettings:
    """`after_s`: hedge an attempt that has not answered after this long (None: `auto`);
    `ratio`: hedges as a share of calls at most; `min_per_s`: hedges always allowed a
    second."""

    after_s: float | None = None
    ratio: float = 0.1
    min_per_s: float = 0.0

    @classmethod
    def parse(cls, after_ms: str, ratio: float = 0.1) -> HedgeSettings | None:
        """The settings of `--hedge-after-ms`: a number of milliseconds, `auto`, or "" / "0"
        / "off" (None: no hedging). ValueError for anything else."""
        text = after_ms.strip().lower()
        if not 0 <= ratio <= 1:
            raise ValueError("--hedge-ratio must be between 0 and 1")
        if text in ("", "0", "off"):
            return None
        if text == AUTO:
            return cls(None, ratio)
        try:
            ms = float(text)
        except ValueError:
            raise ValueError(
                f"--hedge-after-ms {after_ms!r} is not a number of milliseconds, 'auto' or 'off'"
            ) from None
        if not 0 < ms < 3_600_000 or not math.isfinite(ms):
            raise ValueError("--hedge-after-ms must be more than 0 and under an hour (0: off)")
        return cls(ms / 1000, ratio)


class Hedging:
    """One planner's hedging: its delay, its budget and what it did (`sent`: hedges sent;
    `won`: calls a hedge answered; `cancelled`: attempts cancelled because another answered
    first, hedges or not; `budget.refused`: hedges the budget refused)."""

    @classmethod
    def of(
        cls, settings: HedgeSettings | None, clock: Callable[[], float] = time.monotonic
    ) -> Hedging | None:
        """The hedging `settings` ask for (None: none)."""
        return None if settings is None else cls(settings, clock)

    def __init__(
        self,
        settings: HedgeSettings,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        wait: Callable[[threading.Condition, float | None], object] = threading.Condition.wait,
    ) -> None:
        self.settings = settings
        self.sleep = sleep  # the asyncio driver's delay
        self.wait = wait  # the blocking driver's: a wait on its condition, with a timeout
        self.planner: Planner[Any]  # the one it hedges for (`install`)
        self.budget = RetryBudget(settings.ratio, settings.min_per_s, BANK, clock)
        self.sent = 0
        self.won = 0
        self.cancelled = 0
        self._windows: dict[str, deque[float]] = {}  # by backend address
        self._since = 0  # samples since the auto delay was worked out
        self._auto: float | None = None

    def install(self, planner: Planner[Any]) -> None:
        """Hedge `planner`'s calls: its pool weighs backends by their silence too (unless
        given another cost), its OK answers are samples for the auto delay, and its loops
        hand each call that may be hedged to hedging's own."""
        self.planner = planner
        if type(planner.pool.cost) is Cost:
            planner.pool.cost = Silence(planner.pool)
        planner.learn = self.answered
        planner.drive = partial(self._drive, planner.drive)
        planner.drive_sync = partial(self._drive_sync, planner.drive_sync)

    async def _drive(self, plain: Drive[R], plan: Plan[R], attempt: Send[R]) -> R:
        race = self.race(plan)
        if race is None:
            return await plain(plan, attempt)
        return await hedged(race, attempt)

    def _drive_sync(
        self,
        plain: DriveSync[R],
        plan: Plan[R],
        attempt: SendSync[R],
        lock: AbstractContextManager[object],
        start: Start[R] | None,
    ) -> R:
        """Without `start` (which sends an attempt and returns its future), not hedged."""
        race = None if start is None else self.race(plan, lock)  # takes the lock itself
        if race is None or start is None:
            return plain(plan, attempt, lock, start)
        answer: R = hedged_sync(race, start)
        return answer

    def race(
        self, plan: Plan[R], lock: AbstractContextManager[object] = NO_LOCK
    ) -> Race[R, Any] | None:
        """A call's hedged driver state, or None when this call is not hedged: the delay is
        not known yet, or the call has no more time left than the delay. Each call earns
        `ratio` of a hedge."""
        with lock:
            self.budget.deposit()
        after = self.delay()
        if after is None:
            return None
        race: Race[R, Any] = Race(plan, self, after, lock)
        return race if race.hedgeable() else None

    def delay(self) -> float | None:
        """How long an attempt may go unanswered before it is hedged (None: not yet known)."""
        fixed = self.settings.after_s
        return self._auto if fixed is None else fixed

    def answered(self, backend: str, seconds: float) -> None:
        """An attempt answered OK by `backend` (its address) in `seconds`: a sample for the
        auto delay."""
        if self.settings.after_s is not None:
            return
        window = self._windows.get(backend)
        if window is None:
            if len(self._windows) >= MAX_BACKENDS:
                del self._windows[next(iter(self._windows))]  # the longest known
            window = self._windows[backend] = deque(maxlen=WINDOW)
        window.append(seconds)
        self._since += 1
        if self._since >= REFRESH or (self._auto is None and len(window) >= MIN_SAMPLES):
            self._since = 0
            tails = [_tail(w) for w in self._windows.values() if len(w) >= MIN_SAMPLES]
            if tails:
                self._auto = statistics.median(tails)


def _tail(window: deque[float]) -> float:
    """max(p99, 2 x p50) of a backend's window."""
    ordered = sorted(window)
    last = len(ordered) - 1
    return max(ordered[min(last, int(0.99 * len(ordered)))], 2 * ordered[len(ordered) // 2])
