"""One WARNING line per interval with failures, summing them by status from the counts the
serving stats keep (nothing per call), e.g.

    refused 1,234 of 5,678 calls in the last 10.0 s: RESOURCE_EXHAUSTED 1,200, ..."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from sluice.core.words import counted

DEFAULT_INTERVAL_S = 10.0


class CallCounts(Protocol):
    """Calls started and failed calls by status name, both only rising."""

    @property
    def requests(self) -> int: ...

    @property
    def errors(self) -> Mapping[str, int]: ...


class RefusalLog:
    def __init__(
        self,
        stats: CallCounts,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.stats = stats
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._since = clock()
        self._requests = stats.requests
        self._errors: Counter[str] = Counter(stats.errors)

    def tick(self) -> str | None:
        """Log and return the line for the calls since the last tick (None: none failed)."""
        now = self._clock()
        requests = self.stats.requests
        errors: Counter[str] = Counter(self.stats.errors)
        calls = requests - self._requests
        failed = errors - self._errors
        elapsed = now - self._since
        self._since, self._requests, self._errors = now, requests, errors
        if not failed:
            return None
        refused = sum(failed.values())
        # A call begun in the previous interval may fail in this one: never "5 of 3".
        calls = max(calls, refused)
        by_code = ", ".join(
            f"{code} {count:,}"
            for code, count in sorted(failed.items(), key=lambda item: (-item[1], item[0]))
        )
        seen = counted(calls, "call")
        line = f"refused {refused:,} of {seen} in the last {elapsed:.1f} s: {by_code}"
        self.logger.warning("%s", line)
        return line

    async def run(self) -> None:
        """Tick every `interval_s` until cancelled."""
        while True:
            await self._sleep(max(0.0, self._since + self.interval_s - self._clock()))
            self.tick()


def start(stats: CallCounts, logger: logging.Logger) -> asyncio.Task[None]:
    """The refusal log as a task on the running loop; cancel it on shutdown."""
    return asyncio.create_task(RefusalLog(stats, logger).run(), name="refusal log")
