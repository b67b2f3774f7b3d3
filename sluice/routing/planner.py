"""The drivers: the one attempt loop that the balancer, the client (given several servers)
and the load generator run, over a `Plan` (sluice.routing.plan), with asyncio (`run`) or
blocking (`run_sync`) senders. With hedging, each hands the call to the hedge layer's driver
(sluice.routing.hedge). docs/DESIGN.md says what retries, what is refused and why."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Generic

from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import Future, Hedging, hedged, hedged_sync
from sluice.routing.limit import Limits
from sluice.routing.plan import NO_LOCK, Attempt, LockedPlan, MakeReply, Observer, Plan, R
from sluice.routing.pool import ANY, Backend, Pool, Want


class Planner(Generic[R]):
    """The calls over one pool and one retry budget. Not thread-safe: one event loop, or
    one thread (the blocking client holds a lock around each step).

    `reply(code, message)` makes the planner's own answers (no backend, deadline passed);
    `broken` are the exception types an attempt raises when its connection or stream broke
    before the reply; an attempt raises TimeoutError when the time it was given ran out."""

    def __init__(
        self,
        pool: Pool,
        budget: RetryBudget,
        reply: MakeReply[R],
        *,
        broken: tuple[type[BaseException], ...] = (),
        clock: Callable[[], float] = time.monotonic,
        hedging: Hedging | None = None,
    ) -> None:
        self.pool = pool
        self.budget = budget
        self.reply = reply
        self.broken = broken
        self.clock = clock
        self.unavailable = 0  # calls answered UNAVAILABLE because no backend could take them
        self.crowded_at = -math.inf  # when a call was last shed or refused for capacity
        self.limits = Limits()  # how many calls each backend can take, from its refusals
        self.known: tuple[type[BaseException], ...] = (TimeoutError, *broken)
        # Told of each attempt answered OK (its backend's address, its seconds).
        self.learn: Callable[[str, float], None] | None = None
        self.hedging = hedging
        if hedging is not None:
            hedging.install(self)

    def plan(self, key: int | None, deadline: float | None, want: Want = ANY) -> Plan[R]:
        """One call: `key` routes it (None: least loaded) among the backends that serve
        `want`, `deadline` is on the planner's clock (None: none), and each attempt gets the
        time left before it."""
        return Plan(self, key, deadline, want)

    async def run(
        self,
        key: int | None,
        deadline: float | None,
        attempt: Callable[[Backend, float | None], Awaitable[R]],
        want: Want = ANY,
        observer: Observer[R] | None = None,
    ) -> R:
        """The call, sending each attempt with `attempt(backend, time_left)`; `observer`, if
        given, is told of each attempt and of the end. What an observer raises fails the
        call (as span code inside an attempt did), once the plan has recorded the attempt."""
        plan = Plan(self, key, deadline, want, observer)
        try:
            race = None if self.hedging is None else self.hedging.race(plan)
            if race is not None:
                return plan.finish(await hedged(race, attempt))
            step = plan.next()
            while isinstance(step, Attempt):
                try:
                    answer = await attempt(step.backend, step.timeout)
                except BaseException as exc:
                    final = plan.error(step, exc)
                else:
                    final = plan.reply(step, answer)
                step = plan.next() if final is None else final
        except BaseException as exc:
            plan.leave(exc)
            raise
        return plan.finish(step)

    def run_sync(
        self,
        key: int | None,
        deadline: float | None,
        attempt: Callable[[Backend, float | None], R],
        lock: AbstractContextManager[object] = NO_LOCK,
        want: Want = ANY,
        observer: Observer[R] | None = None,
        *,
        start: Callable[[Backend, float | None], Future[R]] | None = None,
    ) -> R:
        """`run` for blocking transports; `lock` guards each record (not the sending, nor
        the observer: it is the call's own). With hedging and `start` (which sends an
        attempt and returns its future, as grpc's `.future()` does), the call is hedged."""
        with lock:
            plan = LockedPlan(self, key, deadline, want, observer, lock)
        hedging = self.hedging if start is not None else None
        race = None if hedging is None else hedging.race(plan, lock)  # takes the lock itself
        try:
            if race is not None and start is not None:
                return plan.finish(hedged_sync(race, start))
            step = plan.next()
            while isinstance(step, Attempt):
                step = _sent(plan, step, attempt)
        except BaseException as exc:
            plan.leave(exc)
            raise
        return plan.finish(step)


def _sent(
    plan: Plan[R], step: Attempt, attempt: Callable[[Backend, float | None], R]
) -> Attempt | R:
    """One blocking attempt sent and recorded: the next step, or the call's answer."""
    try:
        answer = attempt(step.backend, step.timeout)
    except BaseException as exc:
        final = plan.error(step, exc)
    else:
        final = plan.reply(step, answer)
    return plan.next() if final is None else final
