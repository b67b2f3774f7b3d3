"""Hedged requests in the call planner, under a fake clock, a fake sleep (the hedge delay ends
when the test says) and attempts the test answers one by one: when a hedge goes and where,
which answer wins, what the loser's backend is told, the budget, the deadline, and the auto
delay."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Sequence

import pytest

from sluice.core.errors import Code
from sluice.routing.breaker import BreakerSettings, State
from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import CROWDED_S, MIN_SAMPLES, HedgeSettings, Hedging, Silence
from sluice.routing.plan import Attempt, ReplyLike
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Pool
from sluice.wire.mux import Reply

DELAY = 0.005


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Timer:
    """The hedge delay's sleep: it ends when the test `fire`s it (the clock moved on)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.waits: list[float] = []
        self._fired: asyncio.Event | None = None

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        self._fired = asyncio.Event()
        await self._fired.wait()

    def fire(self) -> None:
        assert self._fired is not None, "no hedge delay is running"
        self.clock.now += self.waits[-1]
        self._fired.set()


class Gated:
    """Attempts that wait until the test answers them (`answer`), recording each as (address,
    timeout) and each cancelled one."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, float | None]] = []
        self.cancelled: list[str] = []
        self._pending: dict[str, asyncio.Future[Reply]] = {}

    async def __call__(self, backend: Backend, timeout: float | None) -> Reply:
        self.sent.append((backend.address, timeout))
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[backend.address] = future
        try:
            return await future
        except asyncio.CancelledError:
            self.cancelled.append(backend.address)
            raise

    def answer(self, address: str, reply: Reply | BaseException) -> None:
        future = self._pending.pop(address)
        if isinstance(reply, BaseException):
            future.set_exception(reply)
        else:
            future.set_result(reply)


class Told:
    """An observer that writes down what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool, str]] = []

    def attempt_started(self, attempt: Attempt) -> None:
        self.events.append(("started", attempt.backend.address, attempt.hedge, ""))

    def attempt_ended(
        self, attempt: Attempt, reply: ReplyLike | None, error: BaseException | None
    ) -> None:
        what = type(error).__name__ if reply is None else str(reply.code)
        self.events.append(("ended", attempt.backend.address, attempt.hedge, what))

    def ended(self, answer: ReplyLike | None, error: BaseException | None) -> None:
        self.events.append(("answer", "", False, "" if answer is None else str(answer.code)))


def hedged(
    clock: FakeClock,
    addresses: Sequence[str] = ("a:1", "b:1", "c:1"),
    *,
    after_s: float | None = DELAY,
    ratio: float = 0.1,
    min_per_s: float = 1.0,
) -> tuple[Planner[Reply], Timer]:
    pool = Pool(
        breaker=BreakerSettings(failures_to_open=2, jitter=0.0),
        clock=clock,
        rng=random.Random(7),
        table_size=101,
    )
    pool.set_addresses(addresses)
    timer = Timer(clock)
    hedging = Hedging(HedgeSettings(after_s, ratio, min_per_s), clock, timer)
    return Planner(pool, RetryBudget(clock=clock), Reply, clock=clock, hedging=hedging), timer


def ok(body: bytes = b"answer") -> Reply:
    return Reply(0, "", body)


async def settle() -> None:
    """Let every task that can run, run."""
    for _ in range(20):
        await asyncio.sleep(0)


def counts(p: Planner[Reply]) -> tuple[int, int, int]:
    hedging = p.hedging
    assert hedging is not None
    return hedging.sent, hedging.won, hedging.cancelled


def in_flight(p: Planner[Reply]) -> list[int]:
    return [b.in_flight for b in p.pool.backends.values()]


async def first_then_hedge(
    p: Planner[Reply], timer: Timer, gated: Gated, key: int | None = 42, **kw: object
) -> asyncio.Task[Reply]:
    """A call whose first attempt is out, then hedged: both are out when this returns."""
    sent, waits = len(gated.sent), len(timer.waits)
    call = asyncio.ensure_future(p.run(key, p.clock() + 1.0, gated, **kw))  # type: ignore[arg-type]
    await settle()
    assert len(gated.sent) == sent + 1 and timer.waits[waits:] == [DELAY]
    timer.fire()
    await settle()
    assert len(gated.sent) == sent + 2
    return call


def plenty(p: Planner[Reply]) -> None:
    """Budget for every hedge the test asks for."""
    assert p.hedging is not None
    p.hedging.budget.tokens = p.hedging.budget.max_tokens


async def test_a_slow_attempt_is_hedged_elsewhere_and_the_first_ok_answer_wins() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = await first_then_hedge(p, timer, gated)
    (first, _), (second, left) = gated.sent
    assert second != first
    assert left == pytest.approx(1.0 - DELAY)  # the time left when the hedge went
    gated.answer(second, ok(b"hedge"))
    answer = await call
    await settle()
    assert answer.body == b"hedge"
    assert gated.cancelled == [first]
    assert counts(p) == (1, 1, 1)
    loser = p.pool.backends[first]
    # The loser's slot is given back, with no verdict on it; least-loaded choice learns that
    # it took at least the delay.
    assert in_flight(p) == [0, 0, 0]
    assert loser.failures == 0 and loser.breaker.state is State.CLOSED
    assert loser.latency.current() == pytest.approx(DELAY)


async def test_an_attempt_that_answers_within_the_delay_is_not_hedged() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
    await settle()
    assert timer.waits == [DELAY]  # the delay began, and ends with the answer
    gated.answer(gated.sent[0][0], ok())
    assert (await call).code == 0
    assert len(gated.sent) == 1 and counts(p) == (0, 0, 0)


async def test_the_first_attempt_answering_first_cancels_the_hedge() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = await first_then_hedge(p, timer, gated)
    (first, _), (second, _) = gated.sent
    gated.answer(first, ok(b"first"))
    assert (await call).body == b"first"
    await settle()
    assert gated.cancelled == [second]
    assert counts(p) == (1, 0, 1)
    assert in_flight(p) == [0, 0, 0]
    assert p.pool.backends[second].latency.samples == 0  # a hedge cut short tells nothing


async def test_a_keyed_calls_hedge_goes_to_the_next_backend_on_its_ring() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    plenty(p)
    # Each first attempt here is cancelled unanswered, and would stall its backend for the
    # next keys: the ring order alone is under test.
    assert isinstance(p.pool.cost, Silence)
    p.pool.cost.factor = float("inf")
    gated = Gated()
    for key in range(8):
        first = p.pool.choose(key).backend
        assert first is not None
        expected = p.pool.choose(key, [first]).backend
        assert expected is not None
        call = await first_then_hedge(p, timer, gated, key)
        assert [a for a, _ in gated.sent[-2:]] == [first.address, expected.address]
        gated.answer(expected.address, ok())
        await call
        await settle()


async def test_a_call_with_less_time_left_than_the_delay_is_not_hedged() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = asyncio.ensure_future(p.run(42, clock() + DELAY / 2, gated))
    await settle()
    assert timer.waits == []  # no hedge delay even started
    gated.answer(gated.sent[0][0], ok())
    await call
    assert len(gated.sent) == 1 and counts(p) == (0, 0, 0)


async def test_a_spent_hedge_budget_sends_no_hedge() -> None:
    clock = FakeClock()
    p, timer = hedged(clock, ratio=0.0, min_per_s=0.0)
    assert p.hedging is not None
    p.hedging.budget.tokens = 0.0
    gated = Gated()
    call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
    await settle()
    timer.fire()
    await settle()
    assert len(gated.sent) == 1 and p.hedging.budget.refused == 1
    gated.answer(gated.sent[0][0], ok())
    assert (await call).code == 0
    assert counts(p) == (0, 0, 0)


async def test_hedges_are_at_most_the_ratio_of_calls_plus_the_floor() -> None:
    clock = FakeClock()
    p, timer = hedged(clock, ratio=0.1, min_per_s=0.0)
    assert p.hedging is not None
    p.hedging.budget.tokens = 0.0
    gated = Gated()
    for _ in range(40):  # every call slow: each asks for a hedge
        call = asyncio.ensure_future(p.run(None, clock() + 1.0, gated))
        await settle()
        timer.fire()
        await settle()
        gated.answer(gated.sent[-1][0], ok())
        await call
        await settle()
    assert 3 <= counts(p)[0] <= 4  # 10% of 40 (the tenth of a token added up in floats)


async def test_a_hedge_never_goes_to_an_open_breaker_or_a_full_backend() -> None:
    clock = FakeClock()
    p, timer = hedged(clock, ("a:1", "b:1", "c:1"))
    pool = p.pool
    first = pool.choose(42).backend
    assert first is not None
    others = [b for b in pool.backends.values() if b is not first]
    pool.max_ejection_percent = 100.0
    others[0].breaker.eject()  # OPEN
    # The other at its learned limit: it holds one call and its limit is one.
    pool.start(others[1])
    p.limits.refused(others[1], clock(), clock())
    assert p.limits.full(others[1])
    gated = Gated()
    call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
    await settle()
    timer.fire()
    await settle()
    assert [a for a, _ in gated.sent] == [first.address]
    assert counts(p) == (0, 0, 0)
    gated.answer(first.address, ok())
    assert (await call).code == 0


async def test_no_hedge_while_any_backend_is_at_its_learned_limit() -> None:
    """Near capacity a hedge is load: none goes, even to a backend with room."""
    clock = FakeClock()
    p, timer = hedged(clock, ("a:1", "b:1", "c:1"))
    pool = p.pool
    first = pool.choose(42).backend
    assert first is not None
    crowded = next(b for b in pool.backends.values() if b is not first)
    pool.start(crowded)
    p.limits.refused(crowded, clock(), clock())
    assert p.limits.full(crowded)
    gated = Gated()
    call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
    await settle()
    timer.fire()
    await settle()
    assert [a for a, _ in gated.sent] == [first.address]  # the third had room: not hedged
    assert counts(p) == (0, 0, 0)
    gated.answer(first.address, ok())
    assert (await call).code == 0


async def test_a_failure_while_the_hedge_is_out_is_not_retried_again() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = await first_then_hedge(p, timer, gated)
    (first, _), (second, _) = gated.sent
    gated.answer(first, Reply(int(Code.UNAVAILABLE), "gone"))  # would be retried
    await settle()
    assert len(gated.sent) == 2  # the hedge is its retry
    assert p.budget.retries == 0
    gated.answer(second, ok(b"hedge"))
    assert (await call).body == b"hedge"
    assert counts(p) == (1, 1, 0)
    assert p.pool.backends[first].failures == 1  # its own failure still counts


async def test_when_both_fail_the_call_is_retried_once_more_within_the_budget() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = await first_then_hedge(p, timer, gated)
    (first, _), (second, _) = gated.sent
    gated.answer(first, Reply(int(Code.UNAVAILABLE), "gone"))
    gated.answer(second, Reply(int(Code.UNAVAILABLE), "gone too"))
    await settle()
    assert len(gated.sent) == 3 and p.budget.retries == 1
    third = gated.sent[2][0]
    assert third not in (first, second)
    gated.answer(third, ok(b"third"))
    assert (await call).body == b"third"


async def test_a_final_failure_waits_for_the_attempt_still_out() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = await first_then_hedge(p, timer, gated)
    (first, _), (second, _) = gated.sent
    gated.answer(first, Reply(int(Code.INTERNAL), "model failed"))
    await settle()
    assert not call.done()
    gated.answer(second, ok(b"hedge"))
    assert (await call).body == b"hedge"
    plenty(p)
    # Had the hedge failed too, the first final answer would have been the call's.
    call = await first_then_hedge(p, timer, gated)
    (first, _), (second, _) = gated.sent[-2:]
    gated.answer(first, Reply(int(Code.INVALID_ARGUMENT), "bad input"))
    gated.answer(second, Reply(int(Code.INVALID_ARGUMENT), "bad input too"))
    answer = await call
    assert (answer.code, answer.message) == (Code.INVALID_ARGUMENT, "bad input")


async def test_a_cancelled_call_cancels_both_attempts_with_no_verdict() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    told = Told()
    call = await first_then_hedge(p, timer, gated, observer=told)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await settle()
    assert sorted(gated.cancelled) == sorted(a for a, _ in gated.sent)
    assert in_flight(p) == [0, 0, 0]
    assert all(b.failures == 0 for b in p.pool.backends.values())
    assert counts(p) == (1, 0, 0)  # the caller's cancel is no hedge's loss
    assert [e[0] for e in told.events] == ["started", "started", "ended", "ended", "answer"]


async def test_the_observer_is_told_of_the_hedge_and_of_the_attempt_cancelled() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    told = Told()
    call = await first_then_hedge(p, timer, gated, observer=told)
    (first, _), (second, _) = gated.sent
    gated.answer(second, ok())
    await call
    assert told.events == [
        ("started", first, False, ""),
        ("started", second, True, ""),
        ("ended", second, True, "0"),
        ("ended", first, False, "CancelledError"),
        ("answer", "", False, "0"),
    ]


async def test_auto_hedges_after_the_backends_tail_once_one_has_enough_answers() -> None:
    clock = FakeClock()
    p, timer = hedged(clock, after_s=None)
    hedging = p.hedging
    assert hedging is not None
    gated = Gated()
    for i in range(MIN_SAMPLES):  # one key: one backend answers them all
        assert hedging.delay() is None
        call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
        await settle()
        assert timer.waits == []  # not known yet: no hedge
        clock.now += 0.001 * (i + 1)  # 1 ms .. 20 ms
        gated.answer(gated.sent[-1][0], ok())
        await call
    assert hedging.delay() == pytest.approx(0.022)  # max(p99 20 ms, 2 x p50 11 ms)
    call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
    await settle()
    assert timer.waits == [pytest.approx(0.022)]
    gated.answer(gated.sent[-1][0], ok())
    await call


def answers(hedging: Hedging, backend: str, seconds: float, count: int) -> None:
    for _ in range(count):
        hedging.answered(backend, seconds)


async def test_a_first_attempt_its_hedge_cut_short_is_a_sample_for_the_auto_delay() -> None:
    """Were only answers counted, fast hedges (0.5 ms here) would fill the windows and the
    slow first attempts they cut short (2.5 ms) none: the delay would drift down."""
    clock = FakeClock()
    p, timer = hedged(clock, after_s=None)
    hedging = p.hedging
    assert hedging is not None
    for backend in ("a:1", "b:1", "c:1"):
        answers(hedging, backend, 0.001, 100)
    assert hedging.delay() == pytest.approx(0.002)
    gated = Gated()
    for _ in range(40):
        plenty(p)
        call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
        await settle()
        timer.fire()
        await settle()
        clock.now += 0.0005
        gated.answer(gated.sent[-1][0], ok())  # the hedge wins
        await call
        await settle()
    delay = hedging.delay()
    assert delay is not None and delay > 0.0022


def test_the_auto_delay_follows_each_backends_window_of_recent_answers() -> None:
    hedging = Hedging(HedgeSettings(None))
    answers(hedging, "a:1", 0.100, 400)
    answers(hedging, "a:1", 0.002, 400)  # the slow past leaves the window
    assert hedging.delay() == pytest.approx(0.004)


def test_one_slow_backend_of_three_hardly_moves_the_auto_delay() -> None:
    hedging = Hedging(HedgeSettings(None))
    answers(hedging, "a:1", 0.002, 100)
    answers(hedging, "b:1", 0.003, 100)
    # A backend that pauses: a fifth of its answers took 100 ms. Pooled, the answers' p95
    # would be in its pauses.
    for _ in range(20):
        answers(hedging, "c:1", 0.002, 4)
        answers(hedging, "c:1", 0.100, 1)
    assert hedging.delay() == pytest.approx(0.006)  # the median backend's, 2 x its p50


def test_the_auto_delay_is_past_the_bunched_answers_of_a_fast_model() -> None:
    """Answers bunched near their median (p95 1.57 ms of 1.0-1.6 ms): hedging at the p95
    would hedge one ordinary call in twenty. Twice the median hedges none; a rare slow
    answer (one in a hundred) stays below the p99 of a window and does not lift it."""
    hedging = Hedging(HedgeSettings(None))
    rng = random.Random(1)
    for backend in ("a:1", "b:1", "c:1"):
        for i in range(128):
            hedging.answered(backend, 0.010 if i == 64 else rng.uniform(0.0010, 0.0016))
    delay = hedging.delay()
    assert delay is not None and 0.0024 < delay < 0.0032


def test_the_hedge_budget_banks_a_few_hedges_at_most() -> None:
    """A long quiet spell of fast calls does not pay for a burst of hedges after it."""
    clock = FakeClock()
    hedging = Hedging(HedgeSettings(DELAY, ratio=0.1), clock=clock)
    for _ in range(10_000):
        hedging.budget.deposit()
        clock.now += 0.01
    sent = 0
    while hedging.budget.withdraw():
        sent += 1
    assert sent == 10


@pytest.mark.parametrize(
    ("text", "after_s"),
    [("5", 0.005), ("2.5", 0.0025), ("auto", None), (" AUTO ", None)],
)
def test_hedge_after_ms_reads_a_number_or_auto(text: str, after_s: float | None) -> None:
    settings = HedgeSettings.parse(text)
    assert settings is not None and settings.after_s == after_s
    assert (settings.ratio, settings.min_per_s) == (0.1, 0.0)  # a tenth of the calls, no more


@pytest.mark.parametrize("text", ["", "0", "off"])
def test_hedging_is_off_by_default_and_with_zero(text: str) -> None:
    assert HedgeSettings.parse(text) is None


@pytest.mark.parametrize("text", ["-1", "soon", "nan", "inf"])
def test_a_bad_hedge_delay_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--hedge-after-ms"):
        HedgeSettings.parse(text)


async def test_a_hedge_whose_send_raises_at_once_holds_no_slot_and_the_first_still_answers() -> (
    None
):
    """The transport can refuse before it yields (no connection yet): that attempt was never
    out, its slot is given back, and the first attempt's answer is the call's."""
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    first: list[str] = []

    def attempt(backend: Backend, timeout: float | None) -> Awaitable[Reply]:
        if first:
            raise TimeoutError("no connection")  # the hedge's send, raised before a coroutine
        first.append(backend.address)
        return gated(backend, timeout)

    call = asyncio.ensure_future(p.run(42, clock() + 1.0, attempt))
    await settle()
    timer.fire()
    await settle()
    assert in_flight(p).count(1) == 1  # the first only
    gated.answer(first[0], ok())
    assert (await call).code == 0
    assert in_flight(p) == [0, 0, 0]


async def test_an_answer_as_the_delay_runs_out_sends_no_hedge() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
    await settle()
    gated.answer(gated.sent[0][0], ok())
    timer.fire()  # both done by the planner's next wakeup
    assert (await call).code == 0
    assert len(gated.sent) == 1 and counts(p) == (0, 0, 0)


async def test_an_observer_raising_as_attempts_are_cancelled_gives_each_slot_back_once() -> None:
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()

    class Raising(Told):
        def attempt_ended(
            self, attempt: Attempt, reply: ReplyLike | None, error: BaseException | None
        ) -> None:
            super().attempt_ended(attempt, reply, error)
            if isinstance(error, asyncio.CancelledError):
                raise RuntimeError("observer failed")

    call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated, observer=Raising()))
    await settle()
    timer.fire()
    await settle()
    assert len(gated.sent) == 2
    call.cancel()
    with pytest.raises((RuntimeError, asyncio.CancelledError)):
        await call
    assert in_flight(p) == [0, 0, 0]


async def test_no_hedge_within_a_second_of_an_overload_refusal() -> None:
    """A server refused a call for capacity: for CROWDED_S no call is hedged, then hedges
    go again."""
    clock = FakeClock()
    p, timer = hedged(clock)
    gated = Gated()
    call = asyncio.ensure_future(p.run(7, clock() + 1.0, gated))
    await settle()
    overloaded = Reply(int(Code.RESOURCE_EXHAUSTED), "at its limit", retryable=True)
    gated.answer(gated.sent[0][0], overloaded)  # refused before any work: retried elsewhere
    await settle()
    gated.answer(gated.sent[1][0], ok())
    assert (await call).code == 0
    assert p.limits.full(p.pool.backends[gated.sent[0][0]]) is False  # it holds nothing now
    sent = len(gated.sent)
    call = asyncio.ensure_future(p.run(42, clock() + 1.0, gated))
    await settle()
    timer.fire()
    await settle()
    assert len(gated.sent) == sent + 1 and counts(p)[0] == 0  # crowded: not hedged
    gated.answer(gated.sent[-1][0], ok())
    assert (await call).code == 0
    clock.now += CROWDED_S
    call = await first_then_hedge(p, timer, gated)
    assert counts(p)[0] == 1  # a second on: hedged again
    gated.answer(gated.sent[-1][0], ok())
    assert (await call).code == 0
