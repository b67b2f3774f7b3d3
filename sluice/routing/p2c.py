"""Least-loaded choice: power of two random choices over a cost of in-flight calls weighted
by a peak-EWMA latency estimate (as in linkerd2-proxy and tower). Transport-free; the clock
and random source are injected."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class PeakEwma:
    """A latency estimate that jumps up at once on a slow call and decays toward faster
    ones over `decay_s`. Failures count as `penalty_s`, so a backend that fails fast does
    not look fast.

    Beside it, `mean`: an ordinary moving average of the last `window` or so answered calls
    (no peaks, no failure penalty) and `samples`, the calls it has seen since its last
    `reset_mean()`. The peak suits P2C (shun a backend at once); the mean suits outlier
    detection (one slow call must not make a backend an outlier)."""

    def __init__(
        self,
        decay_s: float = 5.0,
        initial_s: float = 0.001,
        penalty_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        window: int = 20,
    ) -> None:
        self.decay_s = decay_s
        self.penalty_s = penalty_s
        self.clock = clock
        self.estimate = initial_s
        self._stamp = clock()
        self.alpha = 1.0 / max(1, window)
        self.mean = 0.0
        self.samples = 0

    def observe(self, seconds: float) -> None:
        """An answered call (or one that ran out of time) took `seconds`."""
        self.samples += 1
        if self.samples == 1:
            self.mean = seconds
        else:
            self.mean += self.alpha * (seconds - self.mean)
        self._peak(seconds)

    def reset_mean(self) -> None:
        """Forget the mean: the next calls build it anew (a backend back from ejection)."""
        self.mean = 0.0
        self.samples = 0

    def _peak(self, seconds: float) -> None:
        now = self.clock()
        if seconds > self.estimate:
            self.estimate = seconds
        else:
            weight = math.exp(-(now - self._stamp) / self.decay_s)
            self.estimate = self.estimate * weight + seconds * (1 - weight)
        self._stamp = now

    def fail(self) -> None:
        """A failed call: the peak estimate takes the penalty; the mean is not told."""
        self._peak(self.penalty_s)

    def current(self) -> float:
        """The estimate decayed to now, as if an instant call had just been seen: idle
        backends with an old peak recover rather than stay shunned forever."""
        elapsed = self.clock() - self._stamp
        return self.estimate * math.exp(-elapsed / self.decay_s)


def p2c(candidates: Sequence[T], cost: Callable[[T], float], rng: random.Random) -> T | None:
    """The cheaper of two distinct random candidates (the only one when there is one)."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(range(len(candidates)), 2)
    first, second = candidates[a], candidates[b]
    return first if cost(first) <= cost(second) else second
