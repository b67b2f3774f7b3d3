"""Admission at the door: whether a request can finish within its deadline, decided before
it queues, from the work ahead (running, then queued in batches and waves over the
instances) at the measured cost of a run, fitted as fixed + per-row seconds. One that
cannot is refused at once, so its caller can go elsewhere in time (docs/DESIGN.md,
"Batching policy")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.core.errors import Overloaded

WEIGHT = 0.1  # about the last ten runs count
WARMUP = 8  # runs measured before the estimate is trusted to refuse anything


class Admission:
    def __init__(self, instances: int, max_rows: int = 1) -> None:
        self.instances = instances
        self.max_rows = max_rows
        self.runs = 0
        self.refused = 0
        self.fixed_s = 0.0
        self.row_s = 0.0
        # Decaying moments of (rows, seconds) per run, for the fit.
        self._rows = self._seconds = self._rows2 = self._rows_seconds = 0.0

    def observe(self, seconds: float, cost: int) -> None:
        """One run of `cost` (rows, or padded positions) took `seconds` of wall time."""
        self.runs += 1
        weight = WEIGHT if self.runs > 1 else 1.0
        x = float(max(cost, 1))
        self._rows += weight * (x - self._rows)
        self._seconds += weight * (seconds - self._seconds)
        self._rows2 += weight * (x * x - self._rows2)
        self._rows_seconds += weight * (x * seconds - self._rows_seconds)
        spread = self._rows2 - self._rows * self._rows
        if spread > 1e-6:
            per_row = (self._rows_seconds - self._rows * self._seconds) / spread
            self.row_s = max(0.0, per_row)
        else:  # one size only: all fixed (a larger batch underpriced; dequeue checks it)
            self.row_s = 0.0
        self.fixed_s = max(0.0, self._seconds - self.row_s * self._rows)

    def run_s(self, cost: float) -> float:
        """Seconds one run of `cost` (rows, or padded positions) is expected to take."""
        return self.fixed_s + self.row_s * cost

    def expected_s(self, ahead: Ahead, cost: int) -> float:
        """Seconds until a request of `cost`, with `ahead` before it, is answered."""
        seconds = self.run_s(ahead.running_cost / ahead.busy) if ahead.busy else 0.0
        if ahead.queued and ahead.queued_cost:
            # Batches count by rows, whatever the lengths.
            rows = ahead.queued_rows or ahead.queued_cost
            runs = min(ahead.queued, math.ceil(rows / self.max_rows))
            waves = math.ceil(runs / self.instances)
            seconds += waves * self.run_s(ahead.queued_cost / runs)
        return seconds + self.run_s(cost)

    def admit(
        self,
        now: float,
        deadline: float | None,
        ahead: Ahead,
        cost: int,
        unit: str = "rows",
    ) -> None:
        """Overloaded unless the request of `cost` can be answered by `deadline`. With nothing
        ahead it is let in: its run keeps the estimate fresh (a server that refused
        everything would never learn it had become fast again)."""
        if deadline is None or not (ahead.busy or ahead.queued) or self.runs < WARMUP:
            return
        expected = self.expected_s(ahead, cost)
        left = deadline - now
        if expected > left:
            self.refused += 1
            held = ahead.queued_cost + ahead.running_cost
            raise Overloaded(
                f"overloaded: the server cannot answer within the deadline (about "
                f"{expected * 1000:.1f} ms of work for {held} {unit} ahead and this request's "
                f"{cost}, {max(left, 0.0) * 1000:.1f} ms left); retry later or elsewhere"
            )


@dataclass(frozen=True, slots=True)
class Ahead:
    """The work before a new request: runs going now, and the queue."""

    busy: int = 0  # instances running a batch
    running_cost: int = 0  # rows, or padded positions
    queued: int = 0
    queued_cost: int = 0
    queued_rows: int = 0  # 0: their cost, where nothing pads
