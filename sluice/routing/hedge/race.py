"""A hedged call: `Race` decides, without I/O, and two drivers do the sending and the
waiting, `hedged` with asyncio tasks and `hedged_sync` with futures (grpc's `.future()`) and
a condition. At most one hedge a call; the first OK answer wins and the other is dropped with
no verdict; a failure while another attempt is out waits for it (docs/DESIGN.md)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sluice.routing.plan import NO_LOCK, Attempt, Plan, R
from sluice.routing.planner import Future
from sluice.routing.pool import Backend

if TYPE_CHECKING:
    from sluice.routing.hedge.policy import Hedging

# How long after a call shed or refused for capacity no hedge is sent: overload's own time.
CROWDED_S = 1.0
# What cancelled an attempt that another attempt of its call answered before (a hedge's).
LOST = "another attempt answered first"

H = TypeVar("H")  # a driver's handle on an attempt out: a task, a future


class Race(Generic[R, H]):
    """One hedged call's decisions: which attempt goes next, when the hedge delay runs, and
    what the call's answer is. `lock` guards what it shares (the pool, the hedge budget)."""

    def __init__(
        self,
        plan: Plan[R],
        hedging: Hedging,
        after: float,
        lock: AbstractContextManager[object] = NO_LOCK,
    ) -> None:
        self.plan = plan
        self.hedging = hedging
        self.after = after
        self.lock = lock
        self.out: dict[H, Attempt] = {}
        self.timing = False  # the hedge delay is running
        self.hedged = False  # the delay ran out once: at most one hedge a call
        self._winner: R | None = None
        self._fallback: R | None = None  # a final answer that is not OK, while another is out

    def sent(self, handle: H, attempt: Attempt) -> None:
        self.out[handle] = attempt

    def unsent(self, attempt: Attempt, error: BaseException) -> Attempt | R | None:
        """`attempt`'s send raised at once: it was never out. The next step, or None to wait."""
        final = self.plan.error(attempt, error)  # raises what is not the planner's
        if self.out:  # the other may yet answer OK
            self._fallback = self._fallback if self._fallback is not None else final
            return None
        return final if final is not None else self.plan.next()

    def arm(self) -> bool:
        """Whether the hedge delay starts now: one attempt out alone, no hedge yet, and the
        call with more time left than the delay."""
        if self.timing or self.hedged or len(self.out) != 1 or not self.hedgeable():
            return False
        self.timing = True
        return True

    def ended(self, handle: H, result: Callable[[], R]) -> None:
        """The attempt `handle` ended; `result()` gives its reply or raises what it raised."""
        attempt = self.out.pop(handle)
        try:
            reply = result()
        except BaseException as exc:
            final = self.plan.error(attempt, exc)  # raises what is not the planner's
        else:
            final = self.plan.reply(attempt, reply)
        if final is not None and final.code == 0 and self._winner is None:
            self._winner = final
            with self.lock:
                self.hedging.won += attempt.hedge
        elif final is not None and self._fallback is None:
            self._fallback = final

    def next(self, timed: bool) -> Attempt | R | None:
        """After a wake (`timed`: the delay ran out), answers read first: the call's answer,
        an attempt to send, or None to wait on what is out (it is the retry, or may yet
        answer OK). With nothing out, the delay stops (`timing`)."""
        if timed:
            self.timing, self.hedged = False, True
        if self._winner is not None:
            return self._winner
        if timed and self.out:
            return self.hedge()
        if self.out:
            return None
        self.timing = False
        return self._fallback if self._fallback is not None else self.plan.next()

    def hedgeable(self) -> bool:
        """Whether the call has more than the delay left (a hedge must have time to answer)."""
        deadline = self.plan.deadline
        return deadline is None or deadline - self.hedging.planner.clock() > self.after

    def hedge(self) -> Attempt | None:
        """A copy of the call to a backend not tried yet (for a keyed call the next on its
        ring), usable, while no backend is at its learned limit and none was shed or refused
        for capacity within CROWDED_S (a hedge is load then), the budget allowing."""
        plan, planner = self.plan, self.hedging.planner
        clock, pool, limits = planner.clock, planner.pool, planner.limits
        left = None if plan.deadline is None else plan.deadline - clock()
        if left is not None and left <= 0:
            return None
        with self.lock:
            if clock() - planner.crowded_at < CROWDED_S or (
                limits and any(limits.full(b) for b in pool.backends.values())
            ):
                return None
            backend = pool.choose(plan.key, plan.tried, plan.want).backend
            if backend is None or not self.hedging.budget.withdraw():
                return None
            self.hedging.sent += 1  # counted before the observer hears of it
        hedge = plan.copy(backend, left)
        if hedge is None:
            with self.lock:
                self.hedging.sent -= 1
        return hedge

    def close(self, cancel: Callable[[H], object], why: BaseException | None = None) -> None:
        """Cancel each attempt still out: answered by another (`why` None), or the call left
        with `why`. Each is taken out before it is told: an observer's raise drops none twice."""
        while self.out:
            handle, attempt = self.out.popitem()
            cancel(handle)
            if why is None:
                self._lost(attempt)
            self.plan.drop(attempt, why or asyncio.CancelledError(LOST))

    def _lost(self, attempt: Attempt) -> None:
        hedging = self.hedging
        with self.lock:
            hedging.cancelled += 1
            if not attempt.hedge:
                # It took longer than the hedge and its delay: a lower bound of its latency,
                # so least-loaded choice shuns a paused backend, and a sample for the auto
                # delay, whose windows would otherwise hold only the attempts fast enough to
                # answer: the delay would drift down into the ordinary calls.
                seconds = hedging.planner.clock() - attempt.sent
                attempt.backend.latency.observe(seconds)
                hedging.answered(attempt.backend.address, seconds)


async def hedged(
    race: Race[R, asyncio.Future[R]],
    attempt: Callable[[Backend, float | None], Awaitable[R]],
) -> R:
    """The asyncio loop with hedging: each attempt a task, the delay a sleep."""
    timer: asyncio.Future[None] | None = None
    step: Attempt | R | None = race.plan.next()
    try:
        while True:
            if isinstance(step, Attempt):
                try:
                    task = asyncio.ensure_future(attempt(step.backend, step.timeout))
                except BaseException as exc:  # raised before it was sent: not out
                    step = race.unsent(step, exc)
                    continue
                race.sent(task, step)
            elif step is not None:
                return step
            if race.arm():
                timer = asyncio.ensure_future(race.hedging.sleep(race.after))
            waiting: set[asyncio.Future[Any]] = {*race.out, *([timer] if timer else [])}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            timed = timer is not None and timer in done
            for ended in [t for t in race.out if t in done]:
                race.ended(ended, ended.result)
            step = race.next(timed)
            if timer is not None and not race.timing:
                timer.cancel()
                timer = None
    except BaseException as exc:  # the caller cancelled, or the transport failed
        race.close(_cancel, exc)
        raise
    finally:
        if timer is not None:
            timer.cancel()
        race.close(_cancel)


def hedged_sync(race: Race[R, Future[R]], start: Callable[[Backend, float | None], Future[R]]) -> R:
    """The blocking loop with hedging: each attempt a future whose end wakes the
    caller's thread; the delay a wait on the same condition."""
    ready = threading.Condition()
    done: list[Future[R]] = []
    clock, wait = race.hedging.planner.clock, race.hedging.wait

    def woken(future: Future[R]) -> None:
        with ready:
            done.append(future)
            ready.notify()

    timer_at: float | None = None
    step: Attempt | R | None = race.plan.next()
    try:
        while True:
            if isinstance(step, Attempt):
                try:
                    future = start(step.backend, step.timeout)
                except BaseException as exc:  # raised before it was sent: not out
                    step = race.unsent(step, exc)
                    continue
                race.sent(future, step)
                future.add_done_callback(woken)
            elif step is not None:
                return step
            if race.arm():
                timer_at = clock() + race.after
            with ready:
                while not done and (timer_at is None or clock() < timer_at):
                    wait(ready, None if timer_at is None else timer_at - clock())
                ended, done[:] = done[:], []
            timed = timer_at is not None and clock() >= timer_at
            for future in ended:
                race.ended(future, future.result)
            step = race.next(timed)
            timer_at = timer_at if race.timing else None
    except BaseException as exc:  # the caller's thread was interrupted, or the transport failed
        race.close(_cancel_future, exc)
        raise
    finally:
        race.close(_cancel_future)


def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel an attempt still out; what it may raise yet is read, not reported as unread."""
    task.cancel()
    task.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _cancel_future(future: Future[Any]) -> None:
    future.cancel()
