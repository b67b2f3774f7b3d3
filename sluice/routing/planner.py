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
the break counts against the backend."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from sluice.core.errors import Code, status_name
from sluice.routing.budget import RetryBudget
from sluice.routing.pool import Backend, Pool


class Outcome(StrEnum):
    OK = "ok"
    REFUSED = "refused"  # refused before any work (a draining server): the `retryable` flag
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
    Outcome.UNAVAILABLE: Rule(retry=True, verdict="failed"),
    # It may have run; inference is pure, so a second run costs load, not correctness.
    Outcome.BROKEN: Rule(retry=True, verdict="failed"),
    # The model failed on this request: another server would most likely fail the same way.
    Outcome.BACKEND_ERROR: Rule(retry=False, verdict="failed"),
    # The caller's time is spent; the backend's latency counts, its breaker is not told.
    Outcome.TIMEOUT: Rule(retry=False, verdict="slow"),
    Outcome.CANCELLED: Rule(retry=False, verdict="neutral"),
    # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...: the backend answered; it is healthy.
    Outcome.CALLER_ERROR: Rule(retry=False, verdict="ok"),
}

# Which outcome a reply's status is; every status not named here is the caller's.
OUTCOME_OF_CODE: dict[int, Outcome] = {
    Code.OK: Outcome.OK,
    Code.UNAVAILABLE: Outcome.UNAVAILABLE,
    Code.INTERNAL: Outcome.BACKEND_ERROR,
    Code.UNKNOWN: Outcome.BACKEND_ERROR,
    Code.DEADLINE_EXCEEDED: Outcome.TIMEOUT,
    Code.CANCELLED: Outcome.CANCELLED,
}


def outcome_of(code: int, retryable: bool = False) -> Outcome:
    """The outcome of a reply with status `code`; `retryable` marks a refusal before work."""
    if retryable and code != Code.OK:
        return Outcome.REFUSED
    return OUTCOME_OF_CODE.get(code, Outcome.CALLER_ERROR)


# RULES by status number, for the per-call path (the same decisions, looked up once).
_RULE_OF_CODE = {int(code): RULES[outcome] for code, outcome in OUTCOME_OF_CODE.items()}
_CALLERS = RULES[Outcome.CALLER_ERROR]
_REFUSED = RULES[Outcome.REFUSED]
_BROKEN = RULES[Outcome.BROKEN]
_TIMEOUT = RULES[Outcome.TIMEOUT]


def rule_of(code: int, retryable: bool = False) -> Rule:
    """RULES[outcome_of(code, retryable)] in one step."""
    if retryable and code:
        return _REFUSED
    return _RULE_OF_CODE.get(code, _CALLERS)


_UNAVAILABLE = int(Code.UNAVAILABLE)
_DEADLINE_EXCEEDED = int(Code.DEADLINE_EXCEEDED)


class ReplyLike(Protocol):
    """What the planner reads of an attempt's reply (sluice.wire.mux.Reply is one)."""

    @property
    def code(self) -> int: ...

    @property
    def message(self) -> str: ...

    @property
    def retryable(self) -> bool: ...


R = TypeVar("R", bound=ReplyLike)


class Planner(Generic[R]):
    """The attempt loop over one pool and one retry budget. Not thread-safe: one event loop.

    `reply(code, message)` makes the planner's own answers (no backend, deadline passed);
    `broken` are the exception types an attempt raises when its connection or stream broke
    before the reply; an attempt raises TimeoutError when the time it was given ran out."""

    def __init__(
        self,
        pool: Pool,
        budget: RetryBudget,
        reply: Callable[[int, str], R],
        *,
        broken: tuple[type[BaseException], ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.budget = budget
        self.reply = reply
        self.broken = broken
        self.clock = clock
        self.unavailable = 0  # calls answered UNAVAILABLE because no backend could take them

    async def run(
        self,
        key: int | None,
        deadline: float | None,
        attempt: Callable[[Backend, float | None], Awaitable[R]],
    ) -> R:
        """One call: `key` routes it (None: least loaded), `deadline` is on the planner's
        clock (None: none), and each attempt gets the time left before it."""
        pool = self.pool
        clock = self.clock
        self.budget.deposit()
        tried: list[Backend] = []
        last = ""  # the last failure, for the message when the call cannot go on
        retry = False  # the next attempt is a retry: it takes a token from the budget
        while True:
            left = None if deadline is None else deadline - clock()
            if left is not None and left <= 0:
                return self.reply(_DEADLINE_EXCEEDED, f"the deadline passed{last}")
            choice = pool.choose(key, tried)
            backend = choice.backend
            if backend is None:
                return self._unavailable(choice.why, last)
            tried.append(backend)
            if retry:
                if not self.budget.withdraw():
                    return self._unavailable("the retry budget is spent", last)
                retry = False
            if not pool.start(backend):
                continue  # its breaker's single half-open probe is out: try the next one
            sent = clock()
            answer: R | None = None
            why = ""
            try:
                answer = await attempt(backend, left)
            except TimeoutError:
                rule, why = _TIMEOUT, "did not answer in time"
            except self.broken as exc:
                rule, why = _BROKEN, str(exc) or type(exc).__name__
            except BaseException:  # cancelled, or a fault in the transport: no verdict
                pool.finish(backend, clock() - sent, "neutral")
                raise
            else:  # rule_of(answer.code, answer.retryable), inlined: this is every call's path
                code = answer.code
                rule = _REFUSED if code and answer.retryable else _RULE_OF_CODE.get(code, _CALLERS)
            pool.finish(backend, clock() - sent, rule.verdict)
            if answer is not None:
                if not rule.retry:
                    return answer
                why = f"{status_name(answer.code)}: {answer.message}"
            elif not rule.retry:  # no reply, and no retry: the planner answers
                code = _DEADLINE_EXCEEDED if rule is _TIMEOUT else _UNAVAILABLE
                return self.reply(code, f"{backend.address}: {why}{last}")
            last = f"; {backend.address}: {why}"
            retry = True

    def _unavailable(self, why: str, last: str) -> R:
        self.unavailable += 1
        return self.reply(_UNAVAILABLE, f"no backend can take the call: {why}{last}")
