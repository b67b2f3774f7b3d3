"""Hedged requests: when a call's attempt has not answered after a delay, a second copy goes
to another backend and the first good answer wins (Envoy's `hedge_on_per_try_timeout`).
Transport-free: the clock and the sleep are injected. The planner (sluice.routing.planner)
sends the hedges; this module holds the policy: the delay, the budget and the counts.

The delay is fixed (`after_s`) or `auto`: the 95th percentile of the latencies of the calls
answered lately (the last `WINDOW` answered attempts over all backends, once `MIN_SAMPLES`
are in; none hedge before). All backends together, not the one the call went to: a backend
that pauses a third of the time has its own p95 inside its pauses, and would never have
its slow calls hedged; what a call usually takes here is the yardstick.

Hedges spend from a budget of their own, not the retry budget: a pause that holds many
calls at once would otherwise spend the tokens that broken streams need for their retries,
and the two bounds are stated (and measured) apart. By default hedges add at most 10% of
the calls (`ratio`), plus `min_per_s` a second so a quiet caller can still hedge."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sluice.routing.budget import RetryBudget

AUTO = "auto"
WINDOW = 256  # answered attempts the auto delay is the p95 of
MIN_SAMPLES = 20  # answered attempts before an auto delay hedges at all
REFRESH = 16  # the auto delay is worked out again every this many samples
QUANTILE = 0.95


@dataclass(frozen=True)
class HedgeSettings:
    """`after_s`: hedge an attempt that has not answered after this long (None: `auto`);
    `ratio`: hedges as a share of calls at most; `min_per_s`: hedges always allowed a
    second."""

    after_s: float | None = None
    ratio: float = 0.1
    min_per_s: float = 1.0

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
        self.budget = RetryBudget(settings.ratio, settings.min_per_s, clock=clock)
        self.sent = 0
        self.won = 0
        self.cancelled = 0
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._since = 0  # samples since the auto delay was worked out
        self._auto: float | None = None

    def delay(self) -> float | None:
        """How long an attempt may go unanswered before it is hedged (None: not yet known)."""
        fixed = self.settings.after_s
        return self._auto if fixed is None else fixed

    def answered(self, seconds: float) -> None:
        """An attempt answered OK in `seconds`: a sample for the auto delay."""
        if self.settings.after_s is not None:
            return
        self._samples.append(seconds)
        self._since += 1
        if len(self._samples) >= MIN_SAMPLES and (self._auto is None or self._since >= REFRESH):
            ordered = sorted(self._samples)
            self._auto = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
            self._since = 0
