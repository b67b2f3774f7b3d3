"""One call's way through the backends, without I/O: the outcomes, the one table of what
each does (RULES), and the `Plan` the drivers (sluice.routing.planner) send for. The clock is
the planner's, status codes are numbers, and an attempt's reply is any `ReplyLike`."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from sluice.core.errors import Code, status_name
from sluice.core.words import counted
from sluice.routing.pool import ANY, Backend, Want

if TYPE_CHECKING:
    from sluice.routing.planner import Planner


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
    hedge: bool = False  # a copy beside an attempt still out (Plan.copy)


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
    """One call's way through the backends. `next()` gives the next attempt (told to the
    observer) or the call's answer; each attempt then ends in one record: `reply`, `error` or
    `drop` (no verdict); the call in `finish` (its answer) or `leave` (an error). Each record
    is made before the observer is told, so what an observer raises leaves none unmade."""

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
        """The next attempt, told to the observer, or the call's answer. Should the observer
        raise, the attempt is given up (its slot back) and the error goes on."""
        step = self._next()
        if isinstance(step, Attempt):
            self._started(step)
        return step

    def copy(self, backend: Backend, left: float | None) -> Attempt | None:
        """A copy of the call on `backend`, beside an attempt still out: not a retry (no
        retry token), told to the observer; None when `backend` refuses it."""
        if not self._claim(backend):
            return None
        self.tried.append(backend)
        attempt = Attempt(backend, left, self._planner.clock(), hedge=True)
        self._started(attempt)
        return attempt

    def reply(self, attempt: Attempt, reply: R) -> R | None:
        """The reply to `attempt`, recorded and told: the call's answer, or None to go on."""
        final = self._replied(attempt, reply)
        if self._observer is not None:
            self._observer.attempt_ended(attempt, reply, None)
        return final

    def error(self, attempt: Attempt, error: BaseException) -> R | None:
        """What `attempt` raised, recorded and told: for TimeoutError or a `broken` error the
        planner's answer, or None to go on; any other error gives the attempt up (no
        verdict) and is raised again."""
        known = isinstance(error, self._planner.known)
        final = None
        if known:
            final = self._failed(attempt, error)
        else:
            self._release(attempt)
        if self._observer is not None:
            self._observer.attempt_ended(attempt, None, error)
        if not known:
            raise error
        return final

    def drop(self, attempt: Attempt, why: BaseException) -> None:
        """`attempt` ended unanswered with no verdict on its backend (cancelled: another
        answered first, or the call left with `why`): its slot given back; told."""
        self._release(attempt)
        if self._observer is not None:
            self._observer.attempt_ended(attempt, None, why)

    def finish(self, answer: R) -> R:
        """The call's `answer`, told to the observer."""
        if self._observer is not None:
            self._observer.ended(answer, None)
        return answer

    def leave(self, error: BaseException) -> None:
        """The call left with `error` (cancelled, the transport or an observer failed), told
        to the observer: every attempt is recorded by then."""
        if self._observer is not None:
            self._observer.ended(None, error)

    def _next(self) -> Attempt | R:
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

    def _replied(self, attempt: Attempt, answer: R) -> R | None:
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
            if planner.learn is not None:
                planner.learn(attempt.backend.address, planner.clock() - attempt.sent)
        if not rule.retry:
            return answer
        self._retry(attempt, f"{status_name(answer.code)}: {answer.message}")
        return None

    def _failed(self, attempt: Attempt, error: BaseException) -> R | None:
        if isinstance(error, TimeoutError):
            rule, why, code = _TIMEOUT, "did not answer in time", _DEADLINE_EXCEEDED
        else:
            rule, why, code = _BROKEN, str(error) or type(error).__name__, _UNAVAILABLE
        self._finish(attempt, rule, answered=False)
        if not rule.retry:
            return self._planner.reply(code, f"{attempt.backend.address}: {why}{self.last}")
        self._retry(attempt, why)
        return None

    def _claim(self, backend: Backend) -> bool:
        return self._planner.pool.start(backend)

    def _release(self, attempt: Attempt) -> None:
        planner = self._planner
        planner.pool.finish(attempt.backend, planner.clock() - attempt.sent, "neutral", False)

    def _started(self, attempt: Attempt) -> None:
        observer = self._observer
        if observer is not None:
            try:
                observer.attempt_started(attempt)
            except BaseException:
                self._release(attempt)
                raise

    def _finish(self, attempt: Attempt, rule: Rule, answered: bool) -> None:
        planner = self._planner
        seconds = planner.clock() - attempt.sent
        planner.pool.finish(attempt.backend, seconds, rule.verdict, answered)

    def _retry(self, attempt: Attempt, why: str) -> None:
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

    def _next(self) -> Attempt | R:
        with self._lock:
            return super()._next()

    def _claim(self, backend: Backend) -> bool:
        with self._lock:
            return super()._claim(backend)

    def _replied(self, attempt: Attempt, answer: R) -> R | None:
        with self._lock:
            return super()._replied(attempt, answer)

    def _failed(self, attempt: Attempt, error: BaseException) -> R | None:
        with self._lock:
            return super()._failed(attempt, error)

    def _release(self, attempt: Attempt) -> None:
        with self._lock:
            super()._release(attempt)
