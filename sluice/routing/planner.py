"""The drivers: the one attempt loop that the balancer, the client (given several servers)
and the load generator run, over a `Plan` (sluice.routing.plan), with asyncio (`run`) or
blocking (`run_sync`) senders; a layer may wrap the loops (`drive`, `drive_sync`).
docs/DESIGN.md says what retries, what is refused and why."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from sluice.routing.budget import RetryBudget
from sluice.routing.limit import Limits
from sluice.routing.plan import NO_LOCK, Attempt, LockedPlan, MakeReply, Observer, Plan, R
from sluice.routing.pool import ANY, Backend, Pool, Want

if TYPE_CHECKING:
    from sluice.routing.hedge import Hedging

T_co = TypeVar("T_co", covariant=True)


class Future(Protocol[T_co]):
    """An attempt sent by a blocking transport (grpc's `stub.Method.future(...)` is one)."""

    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...

    def result(self) -> T_co: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


# An attempt's send (to a backend, with the time left): its answer, or, blocking, its future.
Send = Callable[[Backend, float | None], Awaitable[R]]
SendSync = Callable[[Backend, float | None], R]
Start = Callable[[Backend, float | None], Future[R]]
# A call's loop over its plan: the answer it ends with.
Drive = Callable[[Plan[R], Send[R]], Awaitable[R]]
DriveSync = Callable[[Plan[R], SendSync[R], AbstractContextManager[object], Start[R] | None], R]


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
        self.drive: Drive[R] = drive
        self.drive_sync: DriveSync[R] = drive_sync
        self.hedging = hedging  # the layer around the loops (None: none)
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
        attempt: Send[R],
        want: Want = ANY,
        observer: Observer[R] | None = None,
    ) -> R:
        """The call, sending each attempt with `attempt(backend, time_left)`; `observer`, if
        given, is told of each attempt and of the end. What an observer raises fails the
        call (as span code inside an attempt did), once the plan has recorded the attempt."""
        plan = Plan(self, key, deadline, want, observer)
        try:
            step = await self.drive(plan, attempt)
        except BaseException as exc:
            plan.leave(exc)
            raise
        return plan.finish(step)

    def run_sync(
        self,
        key: int | None,
        deadline: float | None,
        attempt: SendSync[R],
        lock: AbstractContextManager[object] = NO_LOCK,
        want: Want = ANY,
        observer: Observer[R] | None = None,
        *,
        start: Start[R] | None = None,
    ) -> R:
        """`run` for blocking transports; `lock` guards each record (not the sending, nor
        the observer: it is the call's own). `start` sends an attempt and returns its future
        (as grpc's `.future()` does), for a layer that keeps several out at once."""
        with lock:
            plan = LockedPlan(self, key, deadline, want, observer, lock)
        try:
            step = self.drive_sync(plan, attempt, lock, start)
        except BaseException as exc:
            plan.leave(exc)
            raise
        return plan.finish(step)


async def drive(plan: Plan[R], attempt: Send[R]) -> R:
    """The asyncio loop: one attempt at a time until the plan answers."""
    step = plan.next()
    while isinstance(step, Attempt):
        try:
            answer = await attempt(step.backend, step.timeout)
        except BaseException as exc:
            final = plan.error(step, exc)
        else:
            final = plan.reply(step, answer)
        step = plan.next() if final is None else final
    return step


def drive_sync(
    plan: Plan[R],
    attempt: SendSync[R],
    lock: AbstractContextManager[object] = NO_LOCK,
    start: Start[R] | None = None,
) -> R:
    """The blocking loop: one attempt at a time (`lock` and `start` are a layer's)."""
    step = plan.next()
    while isinstance(step, Attempt):
        try:
            answer = attempt(step.backend, step.timeout)
        except BaseException as exc:
            final = plan.error(step, exc)
        else:
            final = plan.reply(step, answer)
        step = plan.next() if final is None else final
    return step
