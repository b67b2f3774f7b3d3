"""The blocking hedged driver (`Planner.run_sync` given `start`), under the fake clock of
test_hedge and fake futures the test answers: the same decisions as the asyncio driver."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

from sluice.routing.breaker import BreakerSettings, State
from sluice.routing.budget import RetryBudget
from sluice.routing.hedge import HedgeSettings, Hedging
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Pool
from sluice.wire.mux import Reply
from tests.unit.test_hedge import DELAY, FakeClock, counts, in_flight, ok

WAIT_S = 5.0  # a bound on each step of a test, never reached when it passes


class FakeFuture:
    def __init__(self, address: str) -> None:
        self.address = address
        self.cancelled = False
        self._reply: Reply | None = None
        self._callbacks: list[Callable[[Any], object]] = []

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        self._callbacks.append(fn)

    def result(self) -> Reply:
        assert self._reply is not None
        return self._reply

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def done(self) -> bool:
        return self._reply is not None

    def answer(self, reply: Reply) -> None:
        self._reply = reply
        for fn in self._callbacks:
            fn(self)


class Driven:
    """One blocking call on its own thread; `idle` says when it waits (in the fake wait)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[FakeFuture] = []
        self.waits: list[float | None] = []
        self.idle = threading.Event()
        self.answer: Reply | None = None
        self._ready: threading.Condition | None = None

    def wait(self, ready: threading.Condition, timeout: float | None) -> None:
        self.waits.append(timeout)
        self._ready = ready
        self.idle.set()
        ready.wait(WAIT_S)

    def start(self, backend: Backend, timeout: float | None) -> FakeFuture:
        future = FakeFuture(backend.address)
        self.sent.append(future)
        return future

    def call(self, p: Planner[Reply], deadline_s: float = 1.0) -> threading.Thread:
        def run() -> None:
            # A real lock, as the blocking client passes: the driver must never take it twice.
            lock = threading.Lock()
            self.answer = p.run_sync(42, self.clock() + deadline_s, _never, lock, start=self.start)
            self.idle.set()

        thread = threading.Thread(target=run)
        thread.start()
        self.settle()
        return thread

    def settle(self) -> None:
        assert self.idle.wait(WAIT_S)
        self.idle.clear()

    def fire(self) -> None:
        """The hedge delay runs out."""
        assert self._ready is not None and self.waits[-1] is not None
        self.clock.now += self.waits[-1]
        with self._ready:
            self._ready.notify()
        self.settle()

    def reply(self, index: int, reply: Reply) -> None:
        self.sent[index].answer(reply)
        self.settle()


def _never(backend: Backend, timeout: float | None) -> Reply:
    raise AssertionError("a hedged blocking call sends with `start`")


def hedged(clock: FakeClock, driven: Driven) -> Planner[Reply]:
    pool = Pool(
        breaker=BreakerSettings(failures_to_open=2, jitter=0.0),
        clock=clock,
        rng=random.Random(7),
        table_size=101,
    )
    pool.set_addresses(("a:1", "b:1", "c:1"))
    hedging = Hedging(HedgeSettings(DELAY, 0.1, 1.0), clock, wait=driven.wait)
    return Planner(pool, RetryBudget(clock=clock), Reply, clock=clock, hedging=hedging)


@pytest.mark.parametrize("winner", [0, 1])
def test_a_slow_blocking_attempt_is_hedged_and_the_first_ok_answer_wins(winner: int) -> None:
    clock = FakeClock()
    driven = Driven(clock)
    p = hedged(clock, driven)
    thread = driven.call(p)
    assert len(driven.sent) == 1 and driven.waits == [pytest.approx(DELAY)]
    driven.fire()
    assert len(driven.sent) == 2 and driven.sent[1].address != driven.sent[0].address
    driven.reply(winner, ok(b"winner"))
    thread.join(WAIT_S)
    assert driven.answer is not None and driven.answer.body == b"winner"
    loser = driven.sent[1 - winner]
    assert loser.cancelled and not driven.sent[winner].cancelled
    assert counts(p) == (1, winner, 1)  # won: calls a hedge answered
    assert in_flight(p) == [0, 0, 0]
    backend = p.pool.backends[loser.address]
    assert backend.failures == 0 and backend.breaker.state is State.CLOSED  # no verdict


def test_a_blocking_attempt_answering_within_the_delay_is_not_hedged() -> None:
    clock = FakeClock()
    driven = Driven(clock)
    p = hedged(clock, driven)
    thread = driven.call(p)
    driven.reply(0, ok())
    thread.join(WAIT_S)
    assert driven.answer is not None and driven.answer.code == 0
    assert len(driven.sent) == 1 and counts(p) == (0, 0, 0)


def test_a_blocking_call_with_less_time_left_than_the_delay_is_not_hedged() -> None:
    clock = FakeClock()
    driven = Driven(clock)
    p = hedged(clock, driven)
    answered = threading.Event()

    def send(backend: Backend, timeout: float | None) -> Reply:
        answered.set()
        return ok()

    assert p.run_sync(42, clock() + DELAY / 2, send, start=driven.start).code == 0
    assert answered.is_set() and driven.sent == [] and driven.waits == []
    assert counts(p) == (0, 0, 0)
