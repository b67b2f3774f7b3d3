"""Admission at the door: whether a request can finish within its deadline, decided before
any work is queued for it. Transport-free; times are on the caller's clock.

Little's law on the visible queue: a new request finishes after the rows ahead of it have
drained through the instances, plus its own run. The drain rate is measured, not
configured: the wall time of each run, per row, as the batcher saw it (thread hops and a
busy CPU included), in a decaying average. A request that cannot make it is refused at
once with RESOURCE_EXHAUSTED, so it costs the server almost nothing and its caller can go
elsewhere while it still has time; one admitted is one the server expects to answer."""

from __future__ import annotations

from sluice.core.errors import Overloaded

WEIGHT = 0.1  # of each new run in the average: about the last ten runs count
WARMUP = 8  # runs measured before the estimate is trusted to refuse anything


class Admission:
    def __init__(self, instances: int) -> None:
        self.instances = max(instances, 1)
        self.row_s = 0.0  # wall seconds per row of a run, decaying average
        self.runs = 0
        self.refused = 0

    def observe(self, seconds: float, rows: int) -> None:
        """One run of `rows` rows took `seconds` of wall time."""
        self.runs += 1
        per_row = seconds / max(rows, 1)
        weight = WEIGHT if self.runs > 1 else 1.0
        self.row_s += weight * (per_row - self.row_s)

    def expected_s(self, ahead: int, rows: int) -> float:
        """Seconds until a request of `rows` rows, with `ahead` rows queued or running
        before it, is answered."""
        return (ahead / self.instances + rows) * self.row_s

    def admit(self, now: float, deadline: float | None, ahead: int, rows: int) -> None:
        """Raise Overloaded unless the request can be answered by `deadline`. With nothing
        ahead it is always let in: it delays nobody, and its run keeps the estimate fresh (a
        server that refused everything would never learn it had become fast again)."""
        if deadline is None or ahead == 0 or self.runs < WARMUP:
            return
        expected = self.expected_s(ahead, rows)
        left = deadline - now
        if expected > left:
            self.refused += 1
            raise Overloaded(
                f"refused: the server cannot answer within the deadline (about "
                f"{expected * 1000:.1f} ms of work for {ahead} queued rows and this request, "
                f"{max(left, 0.0) * 1000:.1f} ms left); retry later or elsewhere"
            )

    def hopeless(self, now: float, deadline: float | None, rows: int) -> bool:
        """Whether a request about to run would finish after its deadline: checked again when
        it leaves the queue, so no run is spent on a caller that has given up."""
        return deadline is not None and deadline < now + rows * self.row_s
