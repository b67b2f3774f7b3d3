"""The product functions one unary Predict runs on a cache miss (perf.callpath): a ratchet on
the call path's length, lowered as the path is cut."""

from __future__ import annotations

import asyncio

import pytest

from perf import callpath
from sluice.runtime.process import event_loop

pytestmark = pytest.mark.e2e

BOUND = 40  # distinct functions of ours per Predict: the goal


def test_a_predict_runs_at_most_the_bound_of_our_functions() -> None:
    with asyncio.Runner(loop_factory=event_loop) as runner:
        found = runner.run(callpath.profile(20))
    assert found.distinct <= BOUND, "\n".join(found.functions)
