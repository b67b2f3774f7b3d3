"""How many calls each backend can take at once, learned from its refusals. Transport-free;
times are the planner's clock.

A server that refuses a call because it cannot answer in time (RESOURCE_EXHAUSTED, marked
retryable) has told us it is full: its limit becomes the calls it held besides the refused
one (and, once known, at most three quarters of the limit it had), cut at most once per
round trip, since the refusals of calls sent before a cut tell nothing new (as TCP cuts
its window once per loss event). The limit then
rises by one for every `limit` calls it answers (additive increase) and is forgotten once
it is four times the load it was last cut at. A backend holding `limit` calls has no
headroom: the planner neither sends it new calls nor retries another server's refusal on
it, and when only full backends are left the call is refused at once instead of queued."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.routing.pool import Backend

DECREASE = 0.75  # of a known limit, when a refusal cuts it again
FORGET = 4.0  # x the load last cut at: no limit any more


@dataclass(slots=True)
class _Limit:
    value: float
    cut_from: float  # the load it was last cut at
    cut_at: float  # when


class Limits:
    def __init__(self) -> None:
        self._limits: dict[str, _Limit] = {}
        self.shed = 0  # calls refused because only full backends were left

    def __bool__(self) -> bool:
        return bool(self._limits)

    def refused(self, backend: Backend, sent: float, now: float) -> None:
        """`backend` refused, for want of capacity, a call sent at `sent`; its in-flight count
        no longer holds that call."""
        known = self._limits.get(backend.address)
        if known is not None and sent < known.cut_at:
            return  # sent before the last cut: that cut already answered for it
        held = float(backend.in_flight)  # besides the refused call
        limit = held if known is None else min(held, known.value * DECREASE)
        self._limits[backend.address] = _Limit(max(1.0, limit), max(1.0, held), now)

    def answered(self, backend: Backend) -> None:
        known = self._limits.get(backend.address)
        if known is None:
            return
        known.value += 1.0 / known.value
        if known.value >= FORGET * known.cut_from:
            del self._limits[backend.address]

    def full(self, backend: Backend) -> bool:
        """Whether `backend` holds as many calls as it can take."""
        known = self._limits.get(backend.address)
        return known is not None and backend.in_flight >= known.value

    def limit(self, backend: Backend) -> float | None:
        known = self._limits.get(backend.address)
        return None if known is None else known.value
