"""The refusal log under a fake clock and fake serving stats."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter

import pytest

from sluice.core.stats import ServingStats
from sluice.runtime.process import JsonFormatter
from sluice.runtime.refusals import RefusalLog

LOGGER = "sluice.test.refusals"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeStats:
    def __init__(self) -> None:
        self.requests = 0
        self.errors: Counter[str] = Counter()

    def calls(self, count: int, **errors: int) -> None:
        self.requests += count
        self.errors.update(errors)


def new_log(stats: FakeStats, clock: FakeClock, interval_s: float = 10.0) -> RefusalLog:
    return RefusalLog(stats, logging.getLogger(LOGGER), interval_s=interval_s, clock=clock)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_one_warning_line_sums_up_an_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock, stats = FakeClock(), FakeStats()
    stats.calls(7, RESOURCE_EXHAUSTED=2)  # before the log starts: not counted
    refusals = new_log(stats, clock)
    stats.calls(5678, RESOURCE_EXHAUSTED=1200, INVALID_ARGUMENT=30, DEADLINE_EXCEEDED=4)
    clock.now += 10.0
    line = refusals.tick()
    assert line == (
        "refused 1,234 of 5,678 calls in the last 10.0 s: "
        "RESOURCE_EXHAUSTED 1,200, INVALID_ARGUMENT 30, DEADLINE_EXCEEDED 4"
    )
    assert lines(caplog) == [line]
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [logging.WARNING]


def test_nothing_is_logged_for_an_interval_without_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    clock, stats = FakeClock(), FakeStats()
    stats.calls(10, UNAVAILABLE=3)
    refusals = new_log(stats, clock)
    clock.now += 10.0
    assert refusals.tick() is None  # nothing at all
    stats.calls(100)
    clock.now += 10.0
    assert refusals.tick() is None  # calls, all answered
    assert lines(caplog) == []


def test_each_interval_counts_only_its_own_calls(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock, stats = FakeClock(), FakeStats()
    refusals = new_log(stats, clock)
    stats.calls(10, UNAVAILABLE=1, INTERNAL=1)
    clock.now += 10.0
    refusals.tick()
    stats.calls(20, UNAVAILABLE=2)
    clock.now += 12.5
    refusals.tick()
    clock.now += 10.0
    refusals.tick()  # nothing new
    assert lines(caplog) == [
        "refused 2 of 10 calls in the last 10.0 s: INTERNAL 1, UNAVAILABLE 1",
        "refused 2 of 20 calls in the last 12.5 s: UNAVAILABLE 2",
    ]


def test_calls_begun_earlier_never_make_more_refused_than_calls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock, stats = FakeClock(), FakeStats()
    stats.calls(3)  # begun before the log started, refused after
    refusals = new_log(stats, clock)
    stats.calls(0, DEADLINE_EXCEEDED=3)
    clock.now += 10.0
    assert refusals.tick() == "refused 3 of 3 calls in the last 10.0 s: DEADLINE_EXCEEDED 3"


def test_reads_the_serving_stats(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = FakeClock()
    stats = ServingStats(window=16, clock=clock)
    refusals = RefusalLog(stats, logging.getLogger(LOGGER), clock=clock)
    for error in (None, "RESOURCE_EXHAUSTED", None):
        stats.end(stats.begin(), error)
    clock.now += 10.0
    assert refusals.tick() == "refused 1 of 3 calls in the last 10.0 s: RESOURCE_EXHAUSTED 1"


async def test_run_ticks_every_interval_until_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock, stats = FakeClock(), FakeStats()
    slept: list[float] = []
    woken = asyncio.Queue[None]()
    proceed = asyncio.Queue[None]()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        woken.put_nowait(None)
        await proceed.get()
        clock.now += seconds

    refusals = RefusalLog(
        stats, logging.getLogger(LOGGER), interval_s=10.0, clock=clock, sleep=sleep
    )
    task = asyncio.create_task(refusals.run())
    await woken.get()  # asleep for the first interval
    stats.calls(4, RESOURCE_EXHAUSTED=4)
    clock.now += 2.5  # the sleep ran long: the line says how long the interval was
    proceed.put_nowait(None)
    await woken.get()  # ticked, asleep for the second
    stats.calls(1)
    proceed.put_nowait(None)
    await woken.get()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slept == [10.0, 10.0, 10.0]
    assert lines(caplog) == ["refused 4 of 4 calls in the last 12.5 s: RESOURCE_EXHAUSTED 4"]


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        new_log(FakeStats(), FakeClock(), interval_s=0)


def test_the_line_goes_through_the_json_logs() -> None:
    clock, stats = FakeClock(), FakeStats()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger = logging.getLogger(LOGGER + ".json")
    logger.addHandler(handler)
    try:
        refusals = RefusalLog(stats, logger, clock=clock)
        stats.calls(2, UNAVAILABLE=1)
        clock.now += 10.0
        refusals.tick()
    finally:
        logger.removeHandler(handler)
    (record,) = records
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "WARNING" and line["logger"] == LOGGER + ".json"
    assert line["message"] == "refused 1 of 2 calls in the last 10.0 s: UNAVAILABLE 1"
