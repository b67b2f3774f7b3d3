"""The call planner: the one attempt loop that the balancer, the client (given several
servers) and the load generator run. Transport-free: the clock is injected, status codes are
numbers, and the transport is a callable `attempt(backend, timeout)` that returns a reply.

A call deposits in the retry budget, then, until it has an answer: picks a backend from the
pool (`Pool.choose`, skipping the ones already tried), sends one attempt with the time left
before the caller's deadline, classifies what came back, tells the pool (`Pool.finish`),
and tries another backend only when the outcome's rule says so, the budget has a token and
time is left. RULES below is the one table of what retries and what counts against a
backend.

Calls in flight on a stream that broke got no reply, but may already have run. Inference
is a pure function of the request, so sending them again is safe; it costs only the load
of a second run, which the retry budget bounds (about 20% of calls). They are retried, and
the break counts against the backend.

A server that refuses a call for want of capacity (RESOURCE_EXHAUSTED, retryable) teaches
the planner its concurrency limit (sluice.routing.limit); calls go, and such refusals are
retried, only where a backend has headroom, and when none has, the call is refused at once
(RESOURCE_EXHAUSTED, retryable) rather than queued.

A call names the model it wants (`Want`): only backends that serve it are tried. One that
answers NOT_FOUND no longer serves it (unloaded since the pool learned what it serves): the
call goes on to another that does, and the server's NOT_FOUND is the answer when none is
left. When no backend serves the model at all, the pool's NOT_FOUND is the answer at once.

A reply the transport made itself, the call never sent (`sent` false: a request over its
server's message limit, which sent would end the stream it shares), is the answer and says
nothing of the backend: the attempt is withdrawn (`Pool.withdraw`: not one of its calls, no
verdict, no latency sample), and it is not retried.

With hedging (`Hedging`, sluice.routing.hedge; --hedge-after-ms), an attempt still
unanswered after the delay gets one hedge: a copy of the call to a backend not tried yet
(`Pool.choose` with those tried and those at their learned limit excluded: for a keyed call
the next on its ring; never one OPEN or ejected), when the call has more time left than the
delay and the hedge budget a token. The first OK answer is the call's, the other attempt is
cancelled: no verdict on its backend, its slot given back; a first attempt cut short tells
its backend's latency estimate only how long it went unanswered. One answer per call: an
outcome that would be retried while the other attempt is out is not (that attempt is its
retry), and a final failure waits for the other, which may still answer OK. Hedges have a
budget of their own, apart from the retry budget, so that a pause, which holds many calls at
once, cannot spend the tokens broken streams need; each is bounded and counted apart. Only
`run` hedges: `run_sync` has no second attempt to wait beside the first (the blocking client
refuses the option). Over the balancer's multiplexed streams a cancelled attempt's caller
stops waiting, but its server, asked over a stream with no per-call cancel, still runs it
(the result cache makes a duplicate cheap). Every planner call may be hedged: PredictStream's
messages and fan-out's chunks are planner calls too.

What else watches a call (tracing, metrics) hangs on this one loop as an `Observer`, told of
each attempt and of the answer; with none, a driver does no more than check for one."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar

from sluice.core.errors import Code, status_name
from sluice.core.words import counted
from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import Hedging
from sluice.routing.limit import Limits
from sluice.routing.pool import ANY, STALL_FACTOR, Backend, Pool, Want


class Outcome(StrEnum):
    OK = "ok"
    REFUSED = "refused"  # refused before any work (a draining server): the `retryable` flag
    OVERLOADED = "overloaded"  # RESOURCE_EXHAUSTED before any work: the server is at its limit
    MISSING = "missing"  # NOT_FOUND: the server does not serve the model (or version) asked for
    UNAVAILABLE = "unavailable"  # UNAVAILABLE: no connection, or the server cannot take it
    BROKEN = "broken"  # the stream broke before the reply: the call may have run
    BACKEND_ERROR = "backend error"  # INTERNAL, UNKNOWN: the backend failed on this call
    TIMEOUT = "timeout"  # DEADLINE_EXCEEDED, or no answer within the time left
    CANCELLED = "cancelled"
    CALLER_ERROR = "caller error"  # any other status: the caller's request; the backend is fine


@dataclass(frozen=True, slots=True)
class Rule:
    retry: bool  # send the call to another backend (budget and deadline allowing)
    verdict: str  # for Pool.finish: 'ok', 'failed', 'slow' or 'neutral'


# The one table: what each outcome does to the call and to the backend's record.
RULES: dict[Outcome, Rule] = {
    Outcome.OK: Rule(retry=False, verdict="ok"),
    # No work was done, and draining is no fault: its health watch already takes it out.
    Outcome.REFUSED: Rule(retry=True, verdict="neutral"),
    # No work was done; busy is no fault. Retried only on a backend with headroom (Limits).
    Outcome.OVERLOADED: Rule(retry=True, verdict="neutral"),
    # Refused before any work, and no fault: servers serve different models, and the pool's
    # record of which may lag an unload by a refresh. Another that serves it may take it.
    Outcome.MISSING: Rule(retry=True, verdict="neutral"),
    Outcome.UNAVAILABLE: Rule(retry=True, verdict="failed"),
    # It may have run; inference is pure, so a second run costs load, not correctness.
    Outcome.BROKEN: Rule(retry=True, verdict="failed"),
    # The model failed on this request: another server would most likely fail the same way.
    Outcome.BACKEND_ERROR: Rule(retry=False, verdict="failed"),
    # The caller's time is spent; the backend's latency counts, and Pool.finish decides
    # whether the timeout was the backend's fault (it had time enough: outlier rules).
    Outcome.TIMEOUT: Rule(retry=False, verdict="slow"),
    Outcome.CANCELLED: Rule(retry=False, verdict="neutral"),
    # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...: the backend answered; it is healthy.
    Outcome.CALLER_ERROR: Rule(retry=False, verdict="ok"),
}

# Which outcome a reply's status is; every status not named here is the caller's.
OUTCOME_OF_CODE: dict[int, Outcome] = {
    Code.OK: Outcome.OK,
    Code.UNAVAILABLE: Outcome.UNAVAILABLE,
    Code.NOT_FOUND: Outcome.MISSING,
    Code.INTERNAL: Outcome.BACKEND_ERROR,
    Code.UNKNOWN: Outcome.BACKEND_ERROR,
    Code.DEADLINE_EXCEEDED: Outcome.TIMEOUT,
    Code.CANCELLED: Outcome.CANCELLED,
}


def outcome_of(code: int, retryable: bool = False) -> Outcome:
    """The outcome of a reply with status `code`; `retryable` marks a refusal before work."""
    if retryable and code == Code.RESOURCE_EXHAUSTED:
        return Outcome.OVERLOADED
    if retryable and code != Code.OK:
        return Outcome.REFUSED
    return OUTCOME_OF_CODE.get(code, Outcome.CALLER_ERROR)


# RULES by status number (the same decisions, looked up once: this is every call's path).
_RULE_OF_CODE = {int(code): RULES[outcome] for code, outcome in OUTCOME_OF_CODE.items()}
_CALLERS = RULES[Outcome.CALLER_ERROR]
_REFUSED = RULES[Outcome.REFUSED]
_OVERLOADED = RULES[Outcome.OVERLOADED]
_MISSING = RULES[Outcome.MISSING]
_BROKEN = RULES[Outcome.BROKEN]
_TIMEOUT = RULES[Outcome.TIMEOUT]


def rule_of(code: int, retryable: bool = False) -> Rule:
    """RULES[outcome_of(code, retryable)] in one step."""
    if retryable and code:
        return _OVERLOADED if code == _RESOURCE_EXHAUSTED else _REFUSED
    return _RULE_OF_CODE.get(code, _CALLERS)


NO_LOCK: AbstractContextManager[object] = nullcontext()
# How long after a call shed or refused for capacity no hedge is sent: overload's own time.
CROWDED_S = 1.0
# What cancelled an attempt that another attempt of its call answered before (a hedge's).
LOST = "another attempt answered first"
_UNAVAILABLE = int(Code.UNAVAILABLE)
_DEADLINE_EXCEEDED = int(Code.DEADLINE_EXCEEDED)
_RESOURCE_EXHAUSTED = int(Code.RESOURCE_EXHAUSTED)


class ReplyLike(Protocol):
    """What the planner reads of an attempt's reply (sluice.wire.mux.Reply is one)."""

    @property
    def code(self) -> int: ...

    @property
    def message(self) -> str: ...

    @property
    def retryable(self) -> bool: ...

    @property
    def sent(self) -> bool: ...


R = TypeVar("R", bound=ReplyLike)
R_co = TypeVar("R_co", bound=ReplyLike, covariant=True)
R_contra = TypeVar("R_contra", bound=ReplyLike, contravariant=True)


class MakeReply(Protocol[R_co]):
    """Makes the planner's own answers (sluice.wire.mux.Reply is one)."""

    def __call__(self, code: int, message: str, *, retryable: bool = False) -> R_co: ...


@dataclass(slots=True)
class Attempt:
    """Where a plan sends its next attempt, and with how much time."""

    backend: Backend
    timeout: float | None  # the time left before the caller's deadline
    sent: float
    hedge: bool = False  # a second copy of an attempt still out (sluice.routing.hedge)


class Observer(Protocol[R_contra]):
    """Watches one call's way through the planner (one per call: the caller makes it). The
    planner's decisions stay its own: an observer is told, and cannot change them."""

    def attempt_started(self, attempt: Attempt) -> None:
        """An attempt is about to go to `attempt.backend`."""

    def attempt_ended(
        self, attempt: Attempt, reply: R_contra | None, error: BaseException | None
    ) -> None:
        """The attempt's `reply`, or what it raised: TimeoutError, a `broken` error (the
        planner may retry either), or anything else (it leaves the call, as `ended` says)."""

    def ended(self, answer: R_contra | None, error: BaseException | None) -> None:
        """The call's answer (a backend's, or the planner's own), or the error it left with
        (the caller cancelled it, or the transport failed)."""


class Plan(Generic[R]):
    """One call's way through the backends, without I/O: `next()` names the next attempt
    (or gives the final answer), `answered` and `failed` record how it went. The drivers,
    `Planner.run` (asyncio) and `Planner.run_sync` (blocking), only do the sending: `step`,
    `replied` and `raised` are those records with the observer told, each after its record
    (what an observer raises then leaves nothing unrecorded)."""

    __slots__ = (
        "_observer",
        "_planner",
        "deadline",
        "key",
        "last",
        "refusal",
        "retry",
        "tried",
        "want",
    )

    def __init__(
        self,
        planner: Planner[R],
        key: int | None,
        deadline: float | None,
        want: Want = ANY,
        observer: Observer[R] | None = None,
    ) -> None:
        self._planner = planner
        self._observer = observer
        self.key = key
        self.deadline = deadline
        self.want = want
        self.tried: list[Backend] = []
        self.last = ""  # the last failure, for the message when the call cannot go on
        self.retry = False  # the next attempt is a retry: it takes a token from the budget
        # A server's refusal (overloaded, or NOT_FOUND): the answer if no backend is left.
        self.refusal: R | None = None
        planner.budget.deposit()

    def next(self) -> Attempt | R:
        planner = self._planner
        clock, pool = planner.clock, planner.pool
        while True:
            left = None if self.deadline is None else self.deadline - clock()
            if left is not None and left <= 0:
                return planner.reply(_DEADLINE_EXCEEDED, f"the deadline passed{self.last}")
            limits = planner.limits
            full = [b for b in pool.backends.values() if limits.full(b)] if limits else []
            want = self.want
            choice = pool.choose(self.key, self.tried + full if full else self.tried, want)
            backend = choice.backend
            if backend is None and choice.code != _UNAVAILABLE:  # no backend serves it
                return planner.reply(choice.code, f"{choice.why}{self.last}")
            if backend is None and full and pool.choose(self.key, self.tried, want).backend:
                # Only full backends stand in the way: refuse now rather than queue.
                limits.shed += 1
                planner.crowded_at = clock()
                held = sum(b.in_flight for b in full)
                why = (
                    f"overloaded: every backend is at its limit ({counted(held, 'call')} in flight)"
                )
                return planner.reply(
                    _RESOURCE_EXHAUSTED, f"{why}; retry later{self.last}", retryable=True
                )
            if backend is None and self.refusal is not None:
                return self.refusal  # the servers' own word: overloaded (retryable), not found
            if backend is None:
                planner.unavailable += 1
                why = f"no backend can take the call: {choice.why}"
                return planner.reply(_UNAVAILABLE, f"{why}{self.last}")
            self.tried.append(backend)
            if self.retry:
                if not planner.budget.withdraw():  # counted by the budget
                    if self.refusal is not None:
                        return self.refusal
                    why = "no backend can take the call: the retry budget is spent"
                    return planner.reply(_UNAVAILABLE, f"{why}{self.last}")
                self.retry = False
            if pool.start(backend):
                return Attempt(backend, left, clock())
            # choose() passed over a breaker whose probe is out, and nothing ran since;
            # should the pool ever change in between, the next backend is tried.

    def answered(self, attempt: Attempt, answer: R) -> R | None:
        """The reply to an attempt: the call's answer, or None to try the next backend."""
        if not answer.sent:  # no outcome of the backend's: withdrawn (see above)
            self._planner.pool.withdraw(attempt.backend)
            return answer
        rule = rule_of(answer.code, answer.retryable)
        self._finish(attempt, rule, answered=True)
        if rule is _OVERLOADED:
            planner = self._planner
            planner.crowded_at = planner.clock()
            planner.limits.refused(attempt.backend, attempt.sent, planner.clock())
            self.refusal = answer
        elif rule is _MISSING:
            self.refusal = answer
            # Only a server whose models were learned was thought to have it (and may have
            # just unloaded it); where nothing is learned, every server would be asked in
            # turn, and a misspelt name would spend the retry budget others need.
            if attempt.backend.models is None:
                return answer
        elif answer.code == 0:
            planner = self._planner
            if planner.limits:
                planner.limits.answered(attempt.backend)
            if planner.hedging is not None:
                planner.hedging.answered(attempt.backend.address, planner.clock() - attempt.sent)
        if not rule.retry:
            return answer
        self._failed(attempt, f"{status_name(answer.code)}: {answer.message}")
        return None

    def failed(self, attempt: Attempt, error: BaseException) -> R | None:
        """An attempt that raised TimeoutError or one of the planner's `broken` errors: the
        planner's own answer, or None to try the next backend."""
        if isinstance(error, TimeoutError):
            rule, why, code = _TIMEOUT, "did not answer in time", _DEADLINE_EXCEEDED
        else:
            rule, why, code = _BROKEN, str(error) or type(error).__name__, _UNAVAILABLE
        self._finish(attempt, rule, answered=False)
        if not rule.retry:
            return self._planner.reply(code, f"{attempt.backend.address}: {why}{self.last}")
        self._failed(attempt, why)
        return None

    def abandon(self, attempt: Attempt) -> None:
        """The attempt ended with no verdict on its backend (the caller cancelled, the
        transport itself failed, or another attempt answered first): its slot is given back."""
        planner = self._planner
        planner.pool.finish(attempt.backend, planner.clock() - attempt.sent, "neutral", False)

    def hedgeable(self, after: float) -> bool:
        """Whether the call has more than `after` seconds left (a hedge sent after that long
        must still have time to answer)."""
        return self.deadline is None or self.deadline - self._planner.clock() > after

    def hedge(self) -> Attempt | None:
        """A second copy of the call, whose attempt is still out: to a backend not tried yet
        (for a keyed call, the next on its ring) that is usable, while no backend is at its
        learned limit, the hedge budget allowing; None when there is none (the call waits
        for its attempt). Told to the observer as `step` tells an attempt."""
        planner = self._planner
        hedging, clock, pool, limits = planner.hedging, planner.clock, planner.pool, planner.limits
        left = None if self.deadline is None else self.deadline - clock()
        if hedging is None or (left is not None and left <= 0):
            return None
        if clock() - planner.crowded_at < CROWDED_S or (
            limits and any(limits.full(b) for b in pool.backends.values())
        ):
            # Overloaded (a call shed or refused for capacity within CROWDED_S), or a
            # backend at its learned limit: a hedge is load the budget would still allow (up
            # to its ratio), and none is sent.
            return None
        backend = pool.choose(self.key, self.tried, self.want).backend
        if backend is None or not hedging.budget.withdraw() or not pool.start(backend):
            return None
        self.tried.append(backend)
        hedging.sent += 1
        hedge = Attempt(backend, left, clock(), hedge=True)
        self._started(hedge)
        return hedge

    def cancelled(self, attempt: Attempt, error: BaseException | None = None) -> None:
        """The attempt was cancelled, unanswered, because another answered first (or, with
        `error`, because the call left with it): no verdict on its backend, its slot given
        back; told to the observer."""
        self.abandon(attempt)
        if error is None and self._planner.hedging is not None:
            self._planner.hedging.cancelled += 1
            if not attempt.hedge:
                # It took longer than the hedge and its delay: a lower bound of its latency,
                # so least-loaded choice shuns a paused backend (its calls, all hedged and
                # cancelled, would otherwise teach it nothing), and a sample for the auto
                # delay, whose windows would otherwise hold only the attempts fast enough to
                # answer: the delay would drift down into the ordinary calls.
                seconds = self._planner.clock() - attempt.sent
                attempt.backend.latency.observe(seconds)
                self._planner.hedging.answered(attempt.backend.address, seconds)
        if self._observer is not None:
            self._observer.attempt_ended(attempt, None, error or asyncio.CancelledError(LOST))

    def step(self) -> Attempt | R:
        """`next()`, an attempt told to the observer. Should the observer raise, the attempt
        is abandoned (its backend's slot, taken by `Pool.start`, given back) and the error
        goes on."""
        step = self.next()
        if isinstance(step, Attempt):
            self._started(step)
        return step

    def _started(self, attempt: Attempt) -> None:
        observer = self._observer
        if observer is not None:
            try:
                observer.attempt_started(attempt)
            except BaseException:
                self.abandon(attempt)
                raise

    def replied(self, attempt: Attempt, reply: R) -> Attempt | R:
        """`answered`, then told to the observer; then the next step, or the answer."""
        final = self.settled(attempt, reply)
        return self.step() if final is None else final

    def settled(self, attempt: Attempt, reply: R) -> R | None:
        """`answered`, then told to the observer."""
        final = self.answered(attempt, reply)
        if self._observer is not None:
            self._observer.attempt_ended(attempt, reply, None)
        return final

    def raised(self, attempt: Attempt, error: BaseException) -> Attempt | R:
        """`failed` for TimeoutError or a `broken` error, then told to the observer; then
        the next step, or the answer. Any other error (the caller cancelled, the transport
        failed) abandons the attempt, is told, and is raised again."""
        final = self.errored(attempt, error)
        return self.step() if final is None else final

    def errored(self, attempt: Attempt, error: BaseException) -> R | None:
        """`raised` without the next step: the planner's answer, or None to try another."""
        known = isinstance(error, self._planner._known)
        final = None
        if known:
            final = self.failed(attempt, error)
        else:
            self.abandon(attempt)
        if self._observer is not None:
            self._observer.attempt_ended(attempt, None, error)
        if not known:
            raise error
        return final

    def ended(self, answer: R) -> R:
        """The call's `answer`, told to the observer."""
        if self._observer is not None:
            self._observer.ended(answer, None)
        return answer

    def left(self, error: BaseException) -> None:
        """The call left with `error` (cancelled, the transport or an observer failed), told
        to the observer: every attempt is recorded by then."""
        if self._observer is not None:
            self._observer.ended(None, error)

    def _finish(self, attempt: Attempt, rule: Rule, answered: bool) -> None:
        planner = self._planner
        seconds = planner.clock() - attempt.sent
        planner.pool.finish(attempt.backend, seconds, rule.verdict, answered)

    def _failed(self, attempt: Attempt, why: str) -> None:
        self.last = f"; {attempt.backend.address}: {why}"
        self.retry = True


class LockedPlan(Plan[R]):
    """A Plan whose records each hold `lock` (the blocking client's threads share the pool);
    its observer is told outside it: the observer is the call's own."""

    __slots__ = ("_lock",)

    def __init__(
        self,
        planner: Planner[R],
        key: int | None,
        deadline: float | None,
        want: Want,
        observer: Observer[R] | None,
        lock: AbstractContextManager[object],
    ) -> None:
        super().__init__(planner, key, deadline, want, observer)
        self._lock = lock

    def next(self) -> Attempt | R:
        with self._lock:
            return super().next()

    def answered(self, attempt: Attempt, answer: R) -> R | None:
        with self._lock:
            return super().answered(attempt, answer)

    def failed(self, attempt: Attempt, error: BaseException) -> R | None:
        with self._lock:
            return super().failed(attempt, error)

    def abandon(self, attempt: Attempt) -> None:
        with self._lock:
            super().abandon(attempt)


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
        self.hedging = hedging  # None: no hedges (`run_sync` never sends any)
        if hedging is not None and not pool.stall_factor:
            # A paused backend's calls all go to hedges: without the silence rule it would
            # keep its share of the choices (a third of a pause's calls, measured).
            pool.stall_factor = STALL_FACTOR
        self.reply = reply
        self.broken = broken
        self.clock = clock
        self.unavailable = 0  # calls answered UNAVAILABLE because no backend could take them
        self.crowded_at = -math.inf  # when a call was last shed or refused for capacity
        self.limits = Limits()  # how many calls each backend can take, from its refusals
        self._known: tuple[type[BaseException], ...] = (TimeoutError, *broken)

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
            hedging = self.hedging
            if hedging is not None:
                hedging.budget.deposit()  # each call earns `ratio` of a hedge
                after = hedging.delay()
                # A call with less time left than the delay is not hedged, nor sent as one.
                if after is not None and plan.hedgeable(after):
                    return plan.ended(await self._hedged(plan, attempt, hedging, after))
            step = plan.step()
            while isinstance(step, Attempt):
                try:
                    answer = await attempt(step.backend, step.timeout)
                except BaseException as exc:
                    step = plan.raised(step, exc)
                else:
                    step = plan.replied(step, answer)
        except BaseException as exc:
            plan.left(exc)
            raise
        return plan.ended(step)

    async def _hedged(
        self,
        plan: Plan[R],
        attempt: Callable[[Backend, float | None], Awaitable[R]],
        hedging: Hedging,
        after: float,
    ) -> R:
        """`run`'s loop with hedging: each attempt is a task, and while one is out alone and
        unanswered after the hedge delay (the call having more time left than that), one
        hedge goes (at most one a call). The first OK answer wins; the attempt still out is
        cancelled and recorded neutrally. An attempt whose outcome would be retried while
        another is out is not: the other is already its retry. A failure that is the
        call's answer (the caller's error, a timeout) waits for an attempt still out,
        which may yet answer OK; when none is left, it is the answer."""
        out: dict[asyncio.Future[R], Attempt] = {}
        timer: asyncio.Future[None] | None = None
        fallback: R | None = None  # a final answer that is not OK, while another is out
        hedged = False
        step: Attempt | R | None = plan.step()
        try:
            while True:
                if isinstance(step, Attempt):
                    sending, step = step, None
                    try:
                        out[asyncio.ensure_future(attempt(sending.backend, sending.timeout))] = (
                            sending
                        )
                    except BaseException as exc:  # raised before it was sent: not out
                        final = plan.errored(sending, exc)  # raises what is not the planner's
                        if out:  # the other may yet answer OK
                            fallback = fallback if fallback is not None else final
                        else:
                            step = final if final is not None else plan.step()
                        continue
                elif step is not None:
                    return step
                if timer is None and not hedged and len(out) == 1 and plan.hedgeable(after):
                    timer = asyncio.ensure_future(hedging.sleep(after))
                waiting: set[asyncio.Future[Any]] = {*out, *([timer] if timer else [])}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                timed = timer is not None and timer in done
                if timed:
                    timer, hedged = None, True
                winner: R | None = None
                # Answers first: an attempt that answered as the delay ran out needs no hedge.
                for task in [t for t in out if t in done]:
                    sent = out.pop(task)
                    try:
                        final = plan.settled(sent, task.result())
                    except BaseException as exc:
                        final = plan.errored(sent, exc)  # raises what is not the planner's
                    if final is not None and final.code == 0 and winner is None:
                        winner = final
                        hedging.won += sent.hedge
                    elif final is not None and fallback is None:
                        fallback = final
                if winner is not None:
                    return winner
                if timed and out:
                    step = plan.hedge()
                    continue
                if out:
                    continue  # what is still out is the retry, or may yet answer OK
                if timer is not None:
                    timer.cancel()
                    timer = None
                step = fallback if fallback is not None else plan.step()
        except BaseException as exc:  # the caller cancelled, or the transport failed
            while out:  # each taken out before it is told: an observer's raise leaves none twice
                task, sent = out.popitem()
                _cancel(task)
                plan.cancelled(sent, exc)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            while out:  # answered by another
                task, sent = out.popitem()
                _cancel(task)
                plan.cancelled(sent)

    def run_sync(
        self,
        key: int | None,
        deadline: float | None,
        attempt: Callable[[Backend, float | None], R],
        lock: AbstractContextManager[object] = NO_LOCK,
        want: Want = ANY,
        observer: Observer[R] | None = None,
    ) -> R:
        """`run` for blocking transports; `lock` guards each step (not the sending, nor the
        observer: it is the call's own). It sends no hedges: a blocking caller has no second
        attempt to wait on beside the first (the blocking client refuses the option)."""
        with lock:
            plan = LockedPlan(self, key, deadline, want, observer, lock)
        try:
            step = plan.step()
            while isinstance(step, Attempt):
                try:
                    answer = attempt(step.backend, step.timeout)
                except BaseException as exc:
                    step = plan.raised(step, exc)
                else:
                    step = plan.replied(step, answer)
        except BaseException as exc:
            plan.left(exc)
            raise
        return plan.ended(step)


def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel an attempt still out; what it may raise yet is read, not reported as unread."""
    task.cancel()
    task.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
