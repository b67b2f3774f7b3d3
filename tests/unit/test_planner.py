"""The call planner under a fake clock, a seeded pool and fake attempts: the time each attempt
gets, which outcomes retry, the retry budget, the deadline, a broken stream, and what the
breakers are told."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from sluice.core.errors import Code
from sluice.routing.breaker import BreakerSettings, State
from sluice.routing.budget import RetryBudget
from sluice.routing.plan import RULES, Attempt, Outcome, outcome_of, rule_of
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Health, Pool
from sluice.wire.mux import Reply


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Broken(Exception):
    """What the fake transport raises for a stream that broke before the reply."""


Step = Reply | type[BaseException] | BaseException


@dataclass
class Transport:
    """Scripted attempts: each backend answers with its next step, after `cost` seconds of
    the fake clock. Every attempt is recorded as (address, timeout it was given)."""

    clock: FakeClock
    script: dict[str, list[Step]]
    cost: float = 0.1
    sent: list[tuple[str, float | None]] = field(default_factory=list)

    async def __call__(self, backend: Backend, timeout: float | None) -> Reply:
        self.sent.append((backend.address, timeout))
        self.clock.now += self.cost
        steps = self.script[backend.address]
        step = steps.pop(0) if len(steps) > 1 else steps[0]
        if isinstance(step, Reply):
            return step
        raise step


def planner(
    clock: FakeClock,
    addresses: Sequence[str] = ("a:1", "b:1", "c:1"),
    *,
    budget: RetryBudget | None = None,
    failures_to_open: int = 2,
) -> Planner[Reply]:
    pool = Pool(
        breaker=BreakerSettings(failures_to_open=failures_to_open, jitter=0.0),
        clock=clock,
        rng=random.Random(7),
        table_size=101,
    )
    pool.set_addresses(addresses)
    return Planner(pool, budget or RetryBudget(clock=clock), Reply, broken=(Broken,), clock=clock)


def ok(body: bytes = b"answer") -> Reply:
    return Reply(0, "", body)


def status(code: Code, message: str = "", retryable: bool = False) -> Reply:
    return Reply(int(code), message, retryable=retryable)


def order(p: Planner[Reply], key: int | None) -> list[str]:
    """The addresses in the order the pool offers them for `key` (nothing in flight)."""
    tried: list[Backend] = []
    while (backend := p.pool.choose(key, tried).backend) is not None:
        tried.append(backend)
    return [b.address for b in tried]


def run(p: Planner[Reply], transport: Transport, deadline: float | None, key: int = 42) -> Reply:
    return asyncio.run(p.run(key, deadline, transport))


def test_every_outcome_has_one_rule() -> None:
    assert set(RULES) == set(Outcome)
    for rule in RULES.values():
        assert rule.verdict in {"ok", "failed", "slow", "neutral"}
    for code in Code:
        for retryable in (False, True):
            assert rule_of(code, retryable) is RULES[outcome_of(code, retryable)]


@pytest.mark.parametrize(
    ("code", "retryable", "outcome"),
    [
        (Code.OK, False, Outcome.OK),
        (Code.UNAVAILABLE, True, Outcome.REFUSED),
        (Code.UNAVAILABLE, False, Outcome.UNAVAILABLE),
        (Code.INTERNAL, False, Outcome.BACKEND_ERROR),
        (Code.UNKNOWN, False, Outcome.BACKEND_ERROR),
        (Code.DEADLINE_EXCEEDED, False, Outcome.TIMEOUT),
        (Code.CANCELLED, False, Outcome.CANCELLED),
        (Code.INVALID_ARGUMENT, False, Outcome.CALLER_ERROR),
        (Code.RESOURCE_EXHAUSTED, False, Outcome.CALLER_ERROR),
        (Code.RESOURCE_EXHAUSTED, True, Outcome.OVERLOADED),
        (Code.NOT_FOUND, False, Outcome.MISSING),
    ],
)
def test_statuses_map_to_outcomes(code: Code, retryable: bool, outcome: Outcome) -> None:
    assert outcome_of(code, retryable) is outcome


def test_each_attempt_gets_the_time_left_before_the_deadline() -> None:
    clock = FakeClock()
    p = planner(clock)
    first, second, third = order(p, 42)
    transport = Transport(
        clock,
        {
            first: [status(Code.UNAVAILABLE, "connection refused")],
            second: [Broken("the stream ended")],
            third: [ok()],
        },
        cost=0.25,
    )
    reply = run(p, transport, deadline=clock.now + 1.0)
    assert reply.code == 0 and reply.body == b"answer"
    assert [a for a, _ in transport.sent] == [first, second, third]
    assert [t for _, t in transport.sent] == pytest.approx([1.0, 0.75, 0.5])


def test_no_deadline_means_no_timeout_on_any_attempt() -> None:
    clock = FakeClock()
    p = planner(clock)
    first, *_ = order(p, 42)
    transport = Transport(clock, {a: [ok()] for a in order(p, 42)})
    transport.script[first] = [status(Code.UNAVAILABLE)]
    assert run(p, transport, deadline=None).code == 0
    assert [t for _, t in transport.sent] == [None, None]


@pytest.mark.parametrize(
    ("step", "attempts", "verdict"),
    [
        (ok(), 1, "ok"),
        (status(Code.UNAVAILABLE, "draining", retryable=True), 2, "neutral"),
        (status(Code.UNAVAILABLE, "connection refused"), 2, "failed"),
        (Broken("the stream ended"), 2, "failed"),
        (status(Code.INTERNAL, "model failed"), 1, "failed"),
        (status(Code.UNKNOWN), 1, "failed"),
        (status(Code.DEADLINE_EXCEEDED), 1, "slow"),
        (TimeoutError(), 1, "slow"),
        (status(Code.CANCELLED), 1, "neutral"),
        (status(Code.INVALID_ARGUMENT, "wrong rank"), 1, "ok"),
        (status(Code.RESOURCE_EXHAUSTED, "queue is full"), 1, "ok"),
    ],
    ids=[
        "ok",
        "refused-while-draining",
        "unavailable",
        "stream-broke",
        "internal",
        "unknown",
        "deadline-exceeded",
        "local-timeout",
        "cancelled",
        "invalid-argument",
        "resource-exhausted",
    ],
)
def test_only_the_table_retries(step: Step, attempts: int, verdict: str) -> None:
    clock = FakeClock()
    p = planner(clock)
    first, second, third = order(p, 42)
    transport = Transport(clock, {first: [step], second: [ok(b"second")], third: [ok()]})
    verdicts: list[tuple[str, str]] = []
    finish = p.pool.finish

    def record(backend: Backend, seconds: float, v: str, answered: bool = True) -> None:
        verdicts.append((backend.address, v))
        finish(backend, seconds, v, answered)

    p.pool.finish = record  # type: ignore[method-assign]
    reply = run(p, transport, deadline=clock.now + 5.0)
    assert len(transport.sent) == attempts
    assert verdicts[0] == (first, verdict)
    if attempts == 2:
        assert reply.body == b"second" and verdicts[1] == (second, "ok")
    elif isinstance(step, Reply):
        assert reply is step  # the backend's own answer goes back to the caller
    else:
        assert reply.code == Code.DEADLINE_EXCEEDED
        assert reply.message == f"{first}: did not answer in time"
    assert all(b.in_flight == 0 for b in p.pool.backends.values())


def test_an_exhausted_budget_stops_retries_with_unavailable() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.5, min_per_s=0.0, clock=clock)  # no floor: tokens are earned
    p = planner(clock, budget=budget)
    transport = Transport(clock, {a: [Broken("the stream ended")] for a in order(p, 42)})
    reply = run(p, transport, deadline=None)  # earns half a token: no retry
    assert reply.code == Code.UNAVAILABLE
    assert reply.message.startswith("no backend can take the call: the retry budget is spent; ")
    assert reply.message.endswith(": the stream ended")
    assert len(transport.sent) == 1 and budget.refused == 1 and p.unavailable == 0
    transport.sent.clear()
    run(p, transport, deadline=None)  # a second half token: one retry now
    assert len(transport.sent) == 2 and budget.retries == 1


def test_a_deadline_that_passes_between_attempts_ends_the_call() -> None:
    clock = FakeClock()
    p = planner(clock)
    transport = Transport(clock, {a: [status(Code.UNAVAILABLE, "refused")] for a in order(p, 42)})
    transport.cost = 0.6
    reply = run(p, transport, deadline=clock.now + 1.0)
    assert len(transport.sent) == 2  # 1.0 s, then 0.4 s left; then none
    assert reply.code == Code.DEADLINE_EXCEEDED
    assert reply.message.startswith("the deadline passed; ")
    assert reply.message.endswith(": UNAVAILABLE: refused")


def test_a_call_past_its_deadline_is_never_sent() -> None:
    clock = FakeClock()
    p = planner(clock)
    transport = Transport(clock, {a: [ok()] for a in order(p, 42)})
    reply = run(p, transport, deadline=clock.now)
    assert reply.code == Code.DEADLINE_EXCEEDED and transport.sent == []


def test_a_broken_stream_is_retried_elsewhere_and_counts_against_its_backend() -> None:
    clock = FakeClock()
    p = planner(clock)
    first, second, _ = order(p, 42)
    transport = Transport(clock, {first: [Broken("the stream failed")], second: [ok()]})
    assert run(p, transport, deadline=clock.now + 1).code == 0
    assert p.pool.backends[first].failures == 1
    assert p.pool.backends[second].failures == 0
    assert p.budget.retries == 1


def test_a_callers_error_never_counts_against_a_backend() -> None:
    clock = FakeClock()
    p = planner(clock, failures_to_open=2)
    first, *_ = order(p, 42)
    transport = Transport(clock, {first: [status(Code.INVALID_ARGUMENT, "wrong rank")]})
    for _ in range(10):
        assert run(p, transport, deadline=None).code == Code.INVALID_ARGUMENT
    backend = p.pool.backends[first]
    assert backend.failures == 0 and backend.breaker.state is State.CLOSED
    assert len(transport.sent) == 10  # and it was never retried


def test_backend_failures_open_its_breaker_and_the_next_call_goes_elsewhere() -> None:
    clock = FakeClock()
    p = planner(clock, failures_to_open=2)
    first, second, _ = order(p, 42)
    transport = Transport(clock, {first: [status(Code.INTERNAL, "boom")], second: [ok()]})
    for _ in range(2):
        assert run(p, transport, deadline=None).code == Code.INTERNAL  # not retried
    assert p.pool.backends[first].breaker.state is State.OPEN
    transport.sent.clear()
    assert run(p, transport, deadline=None).code == 0
    assert [a for a, _ in transport.sent] == [second]


def test_a_draining_refusal_is_retried_and_not_held_against_the_server() -> None:
    clock = FakeClock()
    p = planner(clock, failures_to_open=1)
    first, second, _ = order(p, 42)
    refusal = status(Code.UNAVAILABLE, "node a is draining", retryable=True)
    transport = Transport(clock, {first: [refusal], second: [ok()]})
    for _ in range(3):
        assert run(p, transport, deadline=None).code == 0
    assert p.pool.backends[first].failures == 0
    assert p.pool.backends[first].breaker.state is State.CLOSED


def test_with_no_usable_backend_the_answer_is_unavailable_with_the_reason() -> None:
    clock = FakeClock()
    p = planner(clock, ("a:1", "b:1"))
    for backend in p.pool.backends.values():
        backend.health = Health.NOT_SERVING
    transport = Transport(clock, {})
    reply = run(p, transport, deadline=None)
    assert reply.code == Code.UNAVAILABLE and transport.sent == []
    assert reply.message == (
        "no backend can take the call: none is usable (a:1 not_serving, b:1 not_serving)"
    )
    assert p.unavailable == 1


def test_when_every_backend_failed_the_last_failure_is_named() -> None:
    clock = FakeClock()
    p = planner(clock, ("a:1", "b:1"))
    last = order(p, 42)[-1]
    transport = Transport(
        clock, {a: [status(Code.UNAVAILABLE, f"{a} is down")] for a in order(p, 42)}
    )
    reply = run(p, transport, deadline=None)
    assert reply.code == Code.UNAVAILABLE
    assert reply.message == (
        f"no backend can take the call: every backend was tried; "
        f"{last}: UNAVAILABLE: {last} is down"
    )


def test_a_cancelled_call_gives_no_verdict_and_frees_its_slot() -> None:
    clock = FakeClock()
    p = planner(clock, failures_to_open=1)
    first, *_ = order(p, 42)
    transport = Transport(clock, {first: [asyncio.CancelledError()]})
    with pytest.raises(asyncio.CancelledError):
        run(p, transport, deadline=None)
    backend = p.pool.backends[first]
    assert backend.in_flight == 0 and backend.failures == 0
    assert backend.breaker.state is State.CLOSED


def test_a_backend_whose_probe_is_out_is_passed_over_without_spending_budget() -> None:
    clock = FakeClock()
    p = planner(clock, failures_to_open=1)
    first, second, _ = order(p, 42)
    owner = p.pool.backends[first]
    owner.breaker.failure()  # open
    clock.now = owner.breaker.open_until  # half open: one probe
    assert owner.breaker.acquire()  # someone else's probe is out
    transport = Transport(clock, {first: [ok()], second: [ok(b"second")]})
    reply = run(p, transport, deadline=None)
    assert reply.body == b"second" and p.budget.retries == 0


def test_concurrent_calls_keep_the_pools_books() -> None:
    """Attempts that really wait: every call is counted once and nothing stays in flight."""
    clock = FakeClock()
    p = planner(clock)

    async def attempt(backend: Backend, timeout: float | None) -> Reply:
        await asyncio.sleep(0)
        return ok(backend.address.encode())

    async def many() -> list[Reply]:
        return await asyncio.gather(*(p.run(None, None, attempt) for _ in range(20)))

    replies = asyncio.run(many())
    assert all(r.code == 0 for r in replies)
    assert sum(b.calls for b in p.pool.backends.values()) == 20
    assert all(b.in_flight == 0 for b in p.pool.backends.values())


def busy(message: str = "refused: the server cannot answer within the deadline") -> Reply:
    return status(Code.RESOURCE_EXHAUSTED, message, retryable=True)


def test_an_overload_refusal_is_retried_where_there_is_headroom_and_sets_a_limit() -> None:
    clock = FakeClock()
    p = planner(clock, failures_to_open=1)
    first, second, _ = order(p, 42)
    for backend in p.pool.backends.values():
        backend.in_flight = 3  # other calls each holds
    transport = Transport(clock, {first: [busy()], second: [ok()]})
    assert run(p, transport, deadline=None).code == 0
    assert [a for a, _ in transport.sent] == [first, second]
    backend = p.pool.backends[first]
    assert p.limits.limit(backend) == 3 and p.limits.full(backend)
    assert backend.failures == 0 and backend.breaker.state is State.CLOSED  # busy is no fault
    # While it is full, calls whose key it owns go to the next on the ring, unsent to it.
    transport.sent.clear()
    assert run(p, transport, deadline=None).code == 0
    assert [a for a, _ in transport.sent] == [second]


def test_when_every_backend_is_full_the_call_is_shed_at_once_and_retryable() -> None:
    clock = FakeClock()
    p = planner(clock, ("a:1", "b:1"))
    for backend in p.pool.backends.values():
        backend.in_flight = 3
        p.limits.refused(backend, sent=clock.now, now=clock.now)  # held 3 more: limit 3
    transport = Transport(clock, {})
    reply = run(p, transport, deadline=None)
    assert transport.sent == []
    assert reply.code == Code.RESOURCE_EXHAUSTED and reply.retryable
    assert "every backend is at its limit (6 calls in flight)" in reply.message
    assert p.limits.shed == 1 and p.unavailable == 0


def test_a_backend_out_for_another_reason_is_not_called_full() -> None:
    """Shed only when fullness alone stands in the way; a full backend that is also down
    leaves the answer UNAVAILABLE."""
    clock = FakeClock()
    p = planner(clock, ("a:1", "b:1"))
    full, down = p.pool.backends["a:1"], p.pool.backends["b:1"]
    full.in_flight = 3
    p.limits.refused(full, sent=clock.now, now=clock.now)
    down.health = Health.NOT_SERVING
    transport = Transport(clock, {})
    assert run(p, transport, deadline=None).code == Code.RESOURCE_EXHAUSTED
    full.health = Health.NOT_SERVING
    reply = run(p, transport, deadline=None)
    assert reply.code == Code.UNAVAILABLE and p.limits.shed == 1 and transport.sent == []


def test_a_burst_of_refusals_cuts_the_limit_once_per_round_trip() -> None:
    clock = FakeClock()
    p = planner(clock, ("a:1",))
    backend = p.pool.backends["a:1"]
    sent = clock.now
    backend.in_flight = 9  # ten calls out, all refused as they come back
    clock.now += 0.01
    for _ in range(10):
        p.limits.refused(backend, sent=sent, now=clock.now)
        backend.in_flight = max(0, backend.in_flight - 1)
    assert p.limits.limit(backend) == pytest.approx(9.0)  # once: the 9 it held besides
    backend.in_flight = 8
    p.limits.refused(backend, sent=clock.now + 0.001, now=clock.now + 0.002)
    assert p.limits.limit(backend) == pytest.approx(9 * 0.75)  # a later one cuts again


def test_a_limit_rises_with_answers_and_is_forgotten_far_above_any_refusal() -> None:
    clock = FakeClock()
    p = planner(clock, ("a:1",))
    backend = p.pool.backends["a:1"]
    backend.in_flight = 3
    p.limits.refused(backend, sent=clock.now, now=clock.now)  # held 3 besides: limit 3
    backend.in_flight = 0
    transport = Transport(clock, {"a:1": [ok()]})
    for _ in range(3):  # one window of answers: +1
        run(p, transport, deadline=None)
    assert p.limits.limit(backend) == pytest.approx(4.0, abs=0.1)
    for _ in range(1000):
        p.limits.answered(backend)
        if p.limits.limit(backend) is None:
            break
    assert p.limits.limit(backend) is None and not p.limits  # forgotten at 4 x 3


def test_with_the_budget_spent_a_servers_overload_refusal_is_the_answer() -> None:
    clock = FakeClock()
    budget = RetryBudget(ratio=0.0, min_per_s=0.0, clock=clock)
    p = planner(clock, budget=budget)
    first, _, _ = order(p, 42)
    refusal = busy("refused: the server cannot answer within the deadline")
    transport = Transport(clock, {first: [refusal]})
    reply = run(p, transport, deadline=None)
    assert reply is refusal  # RESOURCE_EXHAUSTED, retryable: not "the retry budget is spent"


# An observer is told of each attempt and of the end, and changes nothing the planner does.


@dataclass
class Told:
    """An Observer that writes down what it is told."""

    events: list[tuple[object, ...]] = field(default_factory=list)
    in_flight: int = 0  # at attempt_started, the backend's calls in flight

    def attempt_started(self, attempt: Attempt) -> None:
        self.in_flight = attempt.backend.in_flight
        self.events.append(("started", attempt.backend.address))

    def attempt_ended(
        self, attempt: Attempt, reply: Reply | None, error: BaseException | None
    ) -> None:
        outcome = reply.code if reply is not None else type(error).__name__
        self.events.append(("ended", attempt.backend.address, outcome))

    def ended(self, answer: Reply | None, error: BaseException | None) -> None:
        self.events.append(("answer", answer.code if answer is not None else type(error).__name__))


def scripted(clock: FakeClock, p: Planner[Reply]) -> Transport:
    first, second, third = order(p, 42)
    return Transport(
        clock,
        {
            first: [status(Code.UNAVAILABLE, "draining", retryable=True)],
            second: [TimeoutError()],  # TIMEOUT does not retry: the planner's own answer
            third: [ok()],
        },
    )


def test_an_observer_is_told_each_attempt_and_the_answer_and_changes_nothing() -> None:
    outcomes = []
    for observed in (False, True):
        clock = FakeClock()
        p = planner(clock)
        transport = scripted(clock, p)
        told = Told()
        reply = asyncio.run(p.run(42, None, transport, observer=told if observed else None))
        outcomes.append((reply, transport.sent, p.budget.retries, clock.now))
    assert outcomes[0] == outcomes[1]  # the same attempts, answer, budget and times
    first, second, _ = order(planner(FakeClock()), 42)
    assert told.events == [
        ("started", first),
        ("ended", first, Code.UNAVAILABLE),
        ("started", second),
        ("ended", second, "TimeoutError"),
        ("answer", Code.DEADLINE_EXCEEDED),
    ]
    assert told.in_flight == 1  # told once the attempt holds its slot


def test_an_observer_hears_the_planners_own_answer_and_a_cancelled_call() -> None:
    clock = FakeClock()
    p = planner(clock)
    told = Told()
    assert asyncio.run(p.run(42, clock.now - 1, Transport(clock, {}), observer=told)).code == (
        Code.DEADLINE_EXCEEDED
    )
    assert told.events == [("answer", Code.DEADLINE_EXCEEDED)]  # no attempt was sent

    first = order(p, 42)[0]
    told = Told()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(
            p.run(42, None, Transport(clock, {first: [asyncio.CancelledError()]}), observer=told)
        )
    assert told.events == [
        ("started", first),
        ("ended", first, "CancelledError"),
        ("answer", "CancelledError"),
    ]
    assert p.pool.backends[first].in_flight == 0


def test_run_sync_tells_an_observer_the_same() -> None:
    clock = FakeClock()
    p = planner(clock)
    transport = scripted(clock, p)

    def blocking(backend: Backend, timeout: float | None) -> Reply:
        coroutine = transport(backend, timeout)
        try:
            coroutine.send(None)
        except StopIteration as done:
            reply: Reply = done.value
            return reply
        raise AssertionError("the fake transport never waits")

    told = Told()
    assert p.run_sync(42, None, blocking, observer=told).code == Code.DEADLINE_EXCEEDED
    assert [e[0] for e in told.events] == ["started", "ended", "started", "ended", "answer"]
    assert told.events[3][2] == "TimeoutError"


class Exploded(Exception):
    """What a faulty observer raises."""


@dataclass
class Faulty(Told):
    """A Told that raises in `hook` (the first time it is called)."""

    hook: str = ""

    def attempt_started(self, attempt: Attempt) -> None:
        self._maybe("attempt_started")
        super().attempt_started(attempt)

    def attempt_ended(
        self, attempt: Attempt, reply: Reply | None, error: BaseException | None
    ) -> None:
        self._maybe("attempt_ended")
        super().attempt_ended(attempt, reply, error)

    def ended(self, answer: Reply | None, error: BaseException | None) -> None:
        self._maybe("ended")
        super().ended(answer, error)

    def _maybe(self, hook: str) -> None:
        if hook == self.hook:
            self.hook = ""
            raise Exploded(hook)


@pytest.mark.parametrize("driver", ["run", "run_sync"])
@pytest.mark.parametrize("hook", ["attempt_started", "attempt_ended", "ended"])
def test_an_observer_that_raises_fails_the_call_once_the_plan_has_recorded_it(
    hook: str, driver: str
) -> None:
    # The observer's error is the call's (as span code inside an attempt was), but only
    # after the plan recorded the attempt: its backend's slot is given back and its breaker
    # has the verdict; a failure before the attempt went abandons it, and nothing is sent.
    clock = FakeClock()
    p = planner(clock)
    first, second, _ = order(p, 42)
    script: dict[str, list[Step]] = {
        first: [status(Code.UNAVAILABLE, "connection refused")],  # retried on `second`
        second: [ok()],
    }
    transport = Transport(clock, script)
    told = Faulty(hook=hook)
    lock = threading.Lock()

    def blocking(backend: Backend, timeout: float | None) -> Reply:
        try:
            transport(backend, timeout).send(None)
        except StopIteration as done:
            reply: Reply = done.value
            return reply
        raise AssertionError("the fake transport never waits")

    with pytest.raises(Exploded, match=hook):
        if driver == "run":
            asyncio.run(p.run(42, None, transport, observer=told))
        else:
            p.run_sync(42, None, blocking, lock, observer=told)
    assert [b.in_flight for b in p.pool.backends.values()] == [0, 0, 0]
    assert not lock.locked()
    backend = p.pool.backends[first]
    if hook == "attempt_started":
        assert transport.sent == [] and backend.failures == 0  # abandoned: no verdict
        assert told.events == [("answer", "Exploded")]
    else:  # the attempt was sent, and the UNAVAILABLE it got counts against its backend
        assert transport.sent[0][0] == first and backend.failures == 1
    if hook == "attempt_ended":
        assert told.events == [("started", first), ("answer", "Exploded")]
    if hook == "ended":  # the answer was second's, recorded before the observer heard it
        assert [address for address, _ in transport.sent] == [first, second]
        assert p.pool.backends[second].latency.current() > 0
        assert told.events[-1] == ("ended", second, Code.OK)
