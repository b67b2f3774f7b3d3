"""Hedged requests: when a call's attempt has not answered after a delay, a second copy goes
to another backend and the first good answer wins (Envoy's `hedge_on_per_try_timeout`).
Transport-free: the clock and the sleep are injected. The planner (sluice.routing.planner)
sends the hedges; this module holds the policy: the delay, the budget and the counts.

The delay is fixed (`after_s`) or `auto`: the median over the backends of each one's
max(p99, 2 x p50) of its last `WINDOW` answered attempts (those with `MIN_SAMPLES` at least;
none hedge before one has). Not the p95: on a fast model the answers bunch, the p95 sits
near the p50, and hedging 5% of ordinary calls spent the budget before a pause came (perf.hedge:
p99.9 100 ms, 402 hedges refused); past the p99 and twice the median, an ordinary call is
seldom hedged and a paused one still early. The median over the backends, not the figure of
the backend the call went to, nor of all answers pooled: a backend that pauses a third of
the time has its own tail inside its pauses, and its slow answers, pooled, would lift the
delay until the hedges that should cut them came too late; one slow backend of three moves
the median little.

Hedges spend from a budget of their own, not the retry budget: a pause that holds many
calls at once would otherwise spend the tokens that broken streams need for their retries,
and the two bounds are stated (and measured) apart. Hedges add at most `ratio` (10%) of the
calls: each call earns a tenth of one, and by default no time-based floor adds more (the
retry budget's `min_per_s`), so the bound holds at any rate; a quiet caller hedges once in
ten calls at most. The bank holds `BANK` hedges at most (the retry budget's 100 would let a
quiet spell pay for a burst of hedges well past the ratio)."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sluice.routing.budget import RetryBudget

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

    def __init__(
        self,
        settings: HedgeSettings,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.settings = settings
        self.sleep = sleep
        self.budget = RetryBudget(settings.ratio, settings.min_per_s, BANK, clock)
        self.sent = 0
        self.won = 0
        self.cancelled = 0
        self._windows: dict[str, deque[float]] = {}  # by backend address
        self._since = 0  # samples since the auto delay was worked out
        self._auto: float | None = None

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
