"""How many calls each backend can take at once, learned from its refusals. Transport-free.

A server that refuses a call because it cannot answer in time (RESOURCE_EXHAUSTED, marked
retryable) has told us its limit: the calls it already holds. The limit then rises by one
for every `limit` calls it answers (additive increase, as TCP's window) and is forgotten
once it is far above anything the backend was refused at; a new refusal sets it again
(multiplicative decrease). A backend holding `limit` calls has no headroom: the planner
neither sends it new calls nor retries another server's refusal on it, and when no backend
has headroom the call is refused at once instead of queued."""

from __future__ import annotations

from sluice.routing.pool import Backend

FORGET = 1024.0  # a limit above this is no limit


class Limits:
    def __init__(self) -> None:
        self._limits: dict[str, float] = {}
        self.shed = 0  # calls refused because no backend had headroom

    def __bool__(self) -> bool:
        return bool(self._limits)

    def refused(self, backend: Backend) -> None:
        """`backend` refused a call for want of capacity, holding `in_flight` others."""
        self._limits[backend.address] = max(1.0, float(backend.in_flight))

    def answered(self, backend: Backend) -> None:
        limit = self._limits.get(backend.address)
        if limit is None:
            return
        limit += 1.0 / limit
        if limit >= FORGET:
            del self._limits[backend.address]
        else:
            self._limits[backend.address] = limit

    def full(self, backend: Backend) -> bool:
        """Whether `backend` holds as many calls as it can take."""
        limit = self._limits.get(backend.address)
        return limit is not None and backend.in_flight >= limit

    def limit(self, backend: Backend) -> float | None:
        return self._limits.get(backend.address)
