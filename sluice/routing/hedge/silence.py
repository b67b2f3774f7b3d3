"""The silence rule, hedging's price of a backend (the pool's `Cost` seam): a paused backend's
calls all go to hedges and are cancelled, giving their slots back and teaching its latency
estimate nothing, so without this rule it would keep its share of the choices (a third of a
pause's calls, measured)."""

from __future__ import annotations

from sluice.routing.pool import Backend, Cost, Pool

STALLED = 3600.0  # added to a stalled backend's cost: more than any latency
STALL_FACTOR = 3.0  # silent this many times its mean latency is stalled


class Silence(Cost):
    """Least-loaded choice by the larger of a backend's latency and its silence (how long it
    has owed an answer); one silent for over `factor` x its mean latency is stalled: it loses
    to any that is not, and keyed calls pass over it."""

    passes_over = True

    def __init__(self, pool: Pool, factor: float = STALL_FACTOR, min_s: float = 0.002) -> None:
        self.pool = pool
        self.factor = factor
        self.min_s = min_s

    def __call__(self, backend: Backend) -> float:
        latency = backend.latency
        silence = self.silence(backend) if backend.owed else 0.0
        cost = (backend.in_flight + 1) * max(latency.current(), silence)
        if silence > self.factor * max(latency.mean, self.min_s):
            # The peak estimates of busy backends on a loaded host reach tens of ms, so a
            # pause would only outweigh them that late: stalled loses outright.
            cost += STALLED
        return cost

    def shunned(self, backend: Backend) -> bool:
        """Stalled: its keys go on along the ring, as an out one's do (its load bound counts
        calls in flight, and those a hedge cancelled are not)."""
        return self.stalled(backend)

    def stalled(self, backend: Backend) -> bool:
        """Whether `backend` has been silent for over `factor` x its mean latency."""
        if not backend.owed:
            return False
        return self.silence(backend) > self.factor * max(backend.latency.mean, self.min_s)

    def silence(self, backend: Backend) -> float:
        """How long `backend` has owed an answer: since its oldest attempt not answered was
        sent, those given up on counted until it answers anything. With nothing in flight,
        what it owes is forgiven after the pool's `probe_after_s`, so the next call may find
        out whether it is back."""
        if not backend.owed:
            return 0.0
        age = self.pool.clock() - backend.owed_since
        return 0.0 if not backend.in_flight and age > self.pool.probe_after_s else age
