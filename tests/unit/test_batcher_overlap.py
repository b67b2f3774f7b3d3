"""The batcher hands an instance its next batch before it answers the batch that ended, so
the model runs while the event loop delivers the answers (their encoding and writes are the
loop's work, not the model's)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from sluice.server.dataplane.batcher import Arrays, Batcher, Pending


class Held:
    """One instance whose runs end when the test says; it records the batches it began."""

    def __init__(self) -> None:
        self.begun: list[list[float]] = []
        self.release: list[asyncio.Event] = []
        self.fail = False

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        return None

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        self.begun.append([float(p.inputs["x"][0, 0]) for p in batch])
        gate = asyncio.Event()
        self.release.append(gate)
        await gate.wait()
        if self.fail:
            raise RuntimeError("the run failed")
        return [dict(p.inputs) for p in batch]


async def settle(held: Held, count: int) -> None:
    """Until `held` has begun `count` batches (a bounded number of loop turns)."""
    for _ in range(100):
        if len(held.begun) >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{count} batches never began: {held.begun}")


@pytest.mark.parametrize("fails", [False, True])
async def test_the_next_batch_begins_before_the_ended_batchs_callers_wake(fails: bool) -> None:
    held = Held()
    held.fail = fails
    batcher = Batcher([held], max_rows=4, budget_s=1.0)
    begun_when_woken: list[int] = []
    failed: list[float] = []

    async def call(value: float) -> None:
        try:
            await batcher.submit({"x": np.full((1, 1), value)}, (), rows=1, group="g")
        except RuntimeError:
            failed.append(value)
        begun_when_woken.append(len(held.begun))

    first = asyncio.ensure_future(call(0.0))
    await settle(held, 1)
    waiting = [asyncio.ensure_future(call(v)) for v in (1.0, 2.0)]
    for _ in range(5):
        await asyncio.sleep(0)  # both queued behind the running batch
    held.release[0].set()
    await settle(held, 2)
    await first
    assert held.begun == [[0.0], [1.0, 2.0]]
    # The first caller woke with the second batch already begun on the instance.
    assert begun_when_woken == [2]
    held.release[1].set()
    await asyncio.gather(*waiting)
    assert begun_when_woken == [2, 2, 2]
    assert failed == ([0.0, 1.0, 2.0] if fails else [])
    assert batcher.busy == 0 and batcher.stats.batches == 2
