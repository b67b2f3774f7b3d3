"""Retry budget: retries may add about `ratio` of the calls, plus a small floor per second
so a quiet balancer can still retry. Transport-free; the clock is injected."""

from __future__ import annotations

import time
from collections.abc import Callable


class RetryBudget:
    def __init__(
        self,
        ratio: float = 0.2,
        min_per_s: float = 10.0,
        max_tokens: float = 100.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.max_tokens = max_tokens
        self.clock = clock
        self.tokens = min_per_s
        self._stamp = clock()
        self.retries = 0
        self.refused = 0

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.max_tokens, self.tokens + (now - self._stamp) * self.min_per_s)
        self._stamp = now

    def deposit(self) -> None:
        """One first attempt: earns `ratio` of a retry."""
        self._refill()
        self.tokens = min(self.max_tokens, self.tokens + self.ratio)

    def withdraw(self) -> bool:
        """Whether one retry may go now; spends a token if so."""
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.retries += 1
            return True
        self.refused += 1
        return False
