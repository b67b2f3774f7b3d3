"""The batcher's wait for a bigger padded batch: while another instance runs, a free one
holds the oldest's bucket for more company, within the budget and the deadlines; with every
instance idle it runs at once."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from sluice.server.dataplane.batcher import Arrays, Batcher, BatchQueue, Pending
from sluice.server.dataplane.padding import Buckets

BUCKETS = Buckets()  # powers of two
GROUP = "text"


def pending(arrival: float, length: int, rows: int = 1, deadline: float | None = None) -> Pending:
    bucket = BUCKETS.of(length)
    assert bucket is not None
    return Pending(
        {}, (), rows, (GROUP, bucket), arrival, deadline, lengths=(length,), bucket=(bucket,)
    )


def no_run(cost: float) -> float:
    return 0.0


def test_a_small_padded_batch_is_held_until_the_budget_from_the_oldest() -> None:
    queue = BatchQueue(max_rows=4, budget_s=0.010, max_queue=100)
    queue.add(pending(0.000, 20))
    queue.add(pending(0.002, 5))  # another bucket: no company for the oldest
    queue.add(pending(0.004, 30))
    assert queue.hold(0.005, no_run) == pytest.approx(0.010)
    assert queue.hold(0.010, no_run) is None  # the budget is spent: take it now


def test_a_full_padded_batch_or_an_unpadded_one_is_not_held() -> None:
    full = BatchQueue(max_rows=2, budget_s=1.0, max_queue=100)
    full.add(pending(0.0, 20))
    full.add(pending(0.1, 5))
    assert full.hold(0.2, no_run) is not None  # one row of the oldest's bucket waits
    full.add(pending(0.3, 30))
    assert full.hold(0.3, no_run) is None
    exact = BatchQueue(max_rows=8, budget_s=1.0, max_queue=100)
    exact.add(Pending({}, (), 1, "g", 0.0))
    assert exact.hold(0.0, no_run) is None
    assert BatchQueue(max_rows=8, budget_s=1.0, max_queue=100).hold(0.0, no_run) is None


def test_no_waiting_request_is_held_past_its_deadline_less_the_run() -> None:
    """Any waiting request's deadline bounds the hold, the oldest's bucket's or another's:
    the batch's run (2 ms + 0.1 ms a position, 64 positions) must end by it."""
    queue = BatchQueue(max_rows=8, budget_s=1.0, max_queue=100)
    queue.add(pending(0.0, 20, deadline=5.0))
    queue.add(pending(0.0, 30))
    queue.add(pending(0.0, 5, deadline=0.100))
    run_s = lambda cost: 0.002 + 0.0001 * cost  # noqa: E731
    assert queue.hold(0.0, run_s) == pytest.approx(0.100 - 0.0084)
    assert queue.hold(0.095, run_s) is None


class Gated:
    """A fake instance that answers each request with its inputs once the test lets it."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.batches: list[list[int]] = []

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        return None

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        self.batches.append([p.lengths[0] for p in batch])
        await self.gate.wait()
        return [dict(p.inputs) for p in batch]


async def submit(batcher: Batcher, length: int) -> Arrays:
    bucket = BUCKETS.of(length)
    assert bucket is not None
    inputs = {"x": np.zeros((1, length), np.int64)}
    return await batcher.submit(
        inputs, ["x"], rows=1, group=(GROUP, bucket), lengths=(length,), bucket=(bucket,)
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_free_instance_waits_for_its_bucket_while_another_runs() -> None:
    now = [0.0]
    runners = [Gated(), Gated()]
    batcher = Batcher(runners, max_rows=8, budget_s=1.0, clock=lambda: now[0])
    first = asyncio.create_task(submit(batcher, 10))  # all idle: runs at once
    await settle()
    assert batcher.busy == 1
    held = [asyncio.create_task(submit(batcher, n)) for n in (12, 9)]
    await settle()
    assert batcher.busy == 1 and len(batcher.queue) == 2  # the free instance waits
    now[0] = 1.5  # past the budget from the oldest's arrival
    other = asyncio.create_task(submit(batcher, 20))  # its arrival looks again
    await settle()
    assert sorted(r.batches for r in runners) == [[[10]], [[12, 9]]]
    for runner in runners:
        runner.gate.set()
    answers = await asyncio.gather(first, *held, other)
    assert [a["x"].shape for a in answers] == [(1, 10), (1, 12), (1, 9), (1, 20)]
    assert batcher.stats.mean_batch == pytest.approx(4 / 3)


async def test_a_held_batch_runs_when_its_budget_ends_with_nothing_else_happening() -> None:
    runners = [Gated(), Gated()]
    batcher = Batcher(runners, max_rows=8, budget_s=0.005)  # the real clock: a real timer
    first = asyncio.create_task(submit(batcher, 10))
    await settle()
    held = asyncio.create_task(submit(batcher, 12))
    busy, free = sorted(runners, key=lambda r: not r.batches)
    free.gate.set()  # the busy one stays busy: only the timer can start the held batch
    assert (await asyncio.wait_for(held, 10.0))["x"].shape == (1, 12)
    busy.gate.set()
    await first
    assert sorted(r.batches for r in runners) == [[[10]], [[12]]]


async def test_with_every_instance_idle_a_padded_request_runs_at_once() -> None:
    now = [0.0]
    runners = [Gated(), Gated()]
    batcher = Batcher(runners, max_rows=8, budget_s=1.0, clock=lambda: now[0])
    calls = [asyncio.create_task(submit(batcher, n)) for n in (10, 12)]
    await settle()
    # The first ran alone on an idle server; the second waits while the first runs.
    assert [r.batches for r in runners].count([]) == 1 and len(batcher.queue) == 1
    for runner in runners:
        runner.gate.set()
    await asyncio.gather(*calls)
    alone = asyncio.create_task(submit(batcher, 40))  # idle again: no wait for company
    await settle()
    assert len(batcher.queue) == 0 and batcher.busy == 0
    assert (await alone)["x"].shape == (1, 40)
