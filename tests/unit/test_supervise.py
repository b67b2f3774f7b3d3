"""The respawn policy of supervised workers, on a fake clock."""

from __future__ import annotations

import pytest

from sluice.runtime.supervise import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_quick_deaths_double_the_delay_up_to_the_maximum() -> None:
    clock = Clock()
    backoff = Backoff(initial_s=0.1, maximum_s=5.0, reset_after_s=10.0, clock=clock)
    delays = []
    for _ in range(9):
        backoff.started()
        clock.now += 0.5  # dies half a second after each start
        delays.append(backoff.delay())
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0])


def test_a_child_that_stayed_up_resets_the_delay() -> None:
    clock = Clock()
    backoff = Backoff(initial_s=0.1, maximum_s=5.0, reset_after_s=10.0, clock=clock)
    for _ in range(5):
        backoff.started()
        clock.now += 1.0
        backoff.delay()
    backoff.started()
    clock.now += 10.0  # up long enough
    assert backoff.delay() == pytest.approx(0.1)
    backoff.started()
    clock.now += 9.9  # not quite: the doubling goes on from there
    assert backoff.delay() == pytest.approx(0.2)


def test_a_child_that_never_started_still_backs_off() -> None:
    backoff = Backoff(initial_s=0.5, maximum_s=2.0, clock=Clock())
    assert [backoff.delay() for _ in range(4)] == pytest.approx([0.5, 1.0, 2.0, 2.0])
