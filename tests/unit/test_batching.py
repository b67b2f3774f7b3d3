"""The micro-batcher: split/merge exactness, the wait bound, cancellation and deadlines."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sluice.core.datatypes import DATATYPES
from sluice.core.errors import DeadlineExpired, Overloaded
from sluice.server.dataplane import staging
from sluice.server.dataplane.admission import WARMUP, Admission, Ahead
from sluice.server.dataplane.batcher import (
    BUDGET,
    DRAINED,
    FULL,
    Arrays,
    Batcher,
    BatchQueue,
    Pending,
)
from sluice.server.dataplane.buffers import BufferPool

DTYPES = [d.dtype.newbyteorder("=") for d in DATATYPES.values()]


@st.composite
def batches(draw: st.DrawFn) -> list[dict[str, np.ndarray]]:
    """Requests that may share a batch: the same names, dtypes and non-batch dimensions."""
    names = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True))
    specs = {
        n: (
            draw(st.sampled_from(DTYPES)),
            draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=3)),
        )
        for n in names
    }
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        rows = draw(st.integers(1, 4))
        requests.append(
            {n: draw(hnp.arrays(dt, (rows, *shape))) for n, (dt, shape) in specs.items()}
        )
    return requests


@settings(max_examples=60, deadline=None)
@given(batches())
def test_merge_then_split_is_exact(requests: list[dict[str, np.ndarray]]) -> None:
    pool = BufferPool()
    merged, buffers = staging.merge(requests, pool)
    rows = [next(iter(r.values())).shape[0] for r in requests]
    for name in requests[0]:
        want = np.concatenate([r[name] for r in requests])
        assert merged[name].dtype == want.dtype
        np.testing.assert_array_equal(merged[name], want)
    back = staging.split(merged, rows)
    for buffer in buffers:
        pool.give(buffer)
    buffer_reused, _ = staging.merge(requests, pool)  # the same buffers come back...
    assert pool.stats().reused == len(buffers)
    for request, result in zip(requests, back, strict=True):  # ...without touching the split
        for name, array in request.items():
            assert result[name].dtype == array.dtype and result[name].shape == array.shape
            np.testing.assert_array_equal(result[name], array)
    del buffer_reused


def test_split_refuses_outputs_that_are_not_batch_major() -> None:
    with pytest.raises(ValueError, match="not the batch"):
        staging.split({"y": np.zeros(3)}, [1, 1])


def test_buffer_pool_is_bounded() -> None:
    pool = BufferPool(max_bytes=1000)
    a = pool.take(np.dtype("float32"), (64,), 3)  # bucket of 4 rows: 1024 bytes
    assert a.shape == (4, 64)
    pool.give(a)
    assert pool.stats().dropped == 1 and pool.stats().bytes == 0


def item(
    arrival: float, rows: int = 1, group: object = "g", deadline: float | None = None
) -> Pending:
    return Pending({}, (), rows, group, arrival, deadline)


def test_take_forms_batches_by_group_budget_and_size() -> None:
    queue = BatchQueue(max_rows=4, budget_s=0.010, max_queue=100)
    for t, g in [(0.000, "a"), (0.001, "b"), (0.002, "a"), (0.003, "a"), (0.020, "a")]:
        queue.add(item(t, group=g))
    taken = queue.take(now=0.030)
    assert taken is not None and taken.reason == BUDGET
    assert [p.arrival for p in taken.batch] == [0.000, 0.002, 0.003]  # 0.020 is past 0.010
    taken = queue.take(now=0.030)
    assert taken is not None and [p.group for p in taken.batch] == ["b"]
    assert taken.reason == DRAINED
    queue.add(item(0.021, rows=3, group="a"))
    taken = queue.take(now=0.030)
    assert taken is not None and taken.reason == FULL and taken.rows == 4


def test_expired_requests_are_dropped_before_inference() -> None:
    queue = BatchQueue(max_rows=8, budget_s=1.0, max_queue=10)
    queue.add(item(0.0, deadline=0.5))
    queue.add(item(0.1, deadline=5.0))
    taken = queue.take(now=1.0)
    assert taken is not None
    assert [p.arrival for p in taken.expired] == [0.0]
    assert [p.arrival for p in taken.batch] == [0.1]


def test_a_full_queue_refuses_at_once() -> None:
    queue = BatchQueue(max_rows=8, budget_s=1.0, max_queue=2)
    queue.add(item(0.0))
    queue.add(item(0.0))
    with pytest.raises(Overloaded, match="queue is full"):
        queue.add(item(0.0))


@settings(max_examples=150, deadline=None)
@given(
    instances=st.integers(1, 3),
    max_rows=st.integers(1, 16),
    fixed_ms=st.floats(0.1, 3.0),
    per_row_ms=st.floats(0.01, 0.5),
    budget_ms=st.floats(0.0, 20.0),
    gaps_ms=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=150),
)
def test_no_request_waits_longer_than_the_budget_plus_one_batch(
    instances: int,
    max_rows: int,
    fixed_ms: float,
    per_row_ms: float,
    budget_ms: float,
    gaps_ms: list[float],
) -> None:
    """Discrete-event simulation of the policy: an idle instance takes the next batch at once.
    Offered load stays within what the instances can serve at full batches (the property
    cannot hold under overload: there the bounded queue and deadlines take over)."""
    compute = lambda rows: fixed_ms + per_row_ms * rows  # noqa: E731
    capacity_gap = compute(max_rows) / (max_rows * instances)  # ms per request at capacity
    gaps = [max(g, capacity_gap) for g in gaps_ms]
    budget = max(budget_ms, compute(max_rows))  # a budget below one full batch is meaningless
    arrivals = np.cumsum(gaps).tolist()
    queue = BatchQueue(max_rows=max_rows, budget_s=budget, max_queue=10_000)
    free_at = [0.0] * instances  # when each instance is next idle
    events = [(t, i) for i, t in enumerate(arrivals)]
    heapq.heapify(events)
    starts: dict[int, float] = {}
    pending: dict[int, Pending] = {}
    now = 0.0
    while events or len(queue):
        if events and (not len(queue) or events[0][0] <= min(free_at)):
            now, index = heapq.heappop(events)
            pending[index] = item(now)
            pending[index].inputs = {"index": np.array([index])}
            queue.add(pending[index])
        else:
            now = max(now, min(free_at))
        for inst in range(instances):
            if free_at[inst] <= now and len(queue):
                taken = queue.take(now)
                assert taken is not None and taken.batch
                for p in taken.batch:
                    starts[int(p.inputs["index"][0])] = now
                free_at[inst] = now + compute(taken.rows)
    longest_batch = compute(max_rows)
    for index, arrival in enumerate(arrivals):
        assert starts[index] - arrival <= budget + longest_batch + 1e-9


class Doubler:
    """A fake instance: y = 2x, one batch at a time, released by the test."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        return None  # a slow instance: always through the queue

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        self.batches.append([int(p.inputs["x"][0]) for p in batch])
        await self.gate.wait()
        return [{"y": np.asarray(p.inputs["x"]) * 2} for p in batch]


async def settle() -> None:
    """Let every ready task run until all wait on something."""
    for _ in range(5):
        await asyncio.sleep(0)


async def submit(batcher: Batcher, x: int, deadline: float | None = None) -> Arrays:
    return await batcher.submit({"x": np.array([x])}, ["y"], rows=1, group="g", deadline=deadline)


async def test_idle_runs_a_request_at_once_alone() -> None:
    runner = Doubler()
    batcher = Batcher([runner], max_rows=32, budget_s=1.0)
    assert (await submit(batcher, 3))["y"].tolist() == [6]
    assert (await submit(batcher, 4))["y"].tolist() == [8]
    assert runner.batches == [[3], [4]]
    assert batcher.stats.mean_batch == 1.0


async def test_a_busy_instance_batches_everything_that_waited() -> None:
    runner = Doubler()
    runner.gate.clear()
    batcher = Batcher([runner], max_rows=4, budget_s=1.0)
    calls = [asyncio.create_task(submit(batcher, x)) for x in range(7)]
    await asyncio.sleep(0)
    runner.gate.set()
    results = await asyncio.gather(*calls)
    assert [r["y"].tolist() for r in results] == [[2 * x] for x in range(7)]
    assert runner.batches == [[0], [1, 2, 3, 4], [5, 6]]
    assert batcher.stats.flushes == {DRAINED: 2, FULL: 1}


async def test_cancelled_and_expired_requests_leave_their_batch_mates_alone() -> None:
    now = [0.0]
    runner = Doubler()
    runner.gate.clear()
    batcher = Batcher([runner], max_rows=8, budget_s=1.0, clock=lambda: now[0])
    first = asyncio.create_task(submit(batcher, 0))
    await asyncio.sleep(0)  # 0 runs alone; the rest wait
    waiting = {x: asyncio.create_task(submit(batcher, x, deadline=5.0)) for x in range(1, 6)}
    doomed = asyncio.create_task(submit(batcher, 9, deadline=1.0))
    await asyncio.sleep(0)
    waiting[2].cancel()  # leaves the queue
    first.cancel()  # its batch is running: it just won't get the answer
    now[0] = 2.0  # 9's deadline passes while it waits
    runner.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(asyncio.CancelledError):
        await waiting.pop(2)
    with pytest.raises(DeadlineExpired):
        await doomed
    for x, task in waiting.items():
        assert (await task)["y"].tolist() == [2 * x]
    assert runner.batches == [[0], [1, 3, 4, 5]]
    assert batcher.stats.expired == 1


async def test_a_failing_batch_fails_each_of_its_requests_and_the_next_batch_runs() -> None:
    class Flaky(Doubler):
        async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
            if len(self.batches) == 0:
                self.batches.append([])
                raise RuntimeError("device lost")
            return await super().run(batch)

    batcher = Batcher([Flaky()], max_rows=8, budget_s=1.0)
    with pytest.raises(RuntimeError, match="device lost"):
        await submit(batcher, 1)
    assert (await submit(batcher, 2))["y"].tolist() == [4]


async def test_full_queue_is_resource_exhausted_at_once() -> None:
    runner = Doubler()
    runner.gate.clear()
    batcher = Batcher([runner], max_rows=1, budget_s=1.0, max_queue=2)
    calls = [asyncio.create_task(submit(batcher, x)) for x in range(3)]  # 1 runs, 2 wait
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await submit(batcher, 99)
    runner.gate.set()
    await asyncio.gather(*calls)
    assert batcher.stats.rejected == 1


async def test_work_spreads_over_instances() -> None:
    runners = [Doubler(), Doubler()]
    for r in runners:
        r.gate.clear()
    batcher = Batcher(runners, max_rows=1, budget_s=1.0)
    calls = [asyncio.create_task(submit(batcher, x)) for x in range(2)]
    await settle()
    assert [len(r.batches) for r in runners] == [1, 1]  # both busy at once
    for r in runners:
        r.gate.set()
    await asyncio.gather(*calls)


class Tiny(Doubler):
    """A fast instance: idle requests run inline, on the caller's task."""

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        self.batches.append([int(inputs["x"][0])])
        return {"y": np.asarray(inputs["x"]) * 2}


async def test_tiny_runs_take_the_inline_fast_path_when_idle() -> None:
    runner = Tiny()
    batcher = Batcher([runner], max_rows=8, budget_s=1.0)
    assert (await submit(batcher, 5))["y"].tolist() == [10]
    assert runner.batches == [[5]] and batcher.stats.batches == 1
    assert batcher.busy == 0 and len(batcher.queue) == 0


class Timed(Doubler):
    """A slow instance on a fake clock: each run takes `seconds` of it."""

    def __init__(self, now: list[float], seconds: float) -> None:
        super().__init__()
        self.now = now
        self.seconds = seconds

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        results = await super().run(batch)
        self.now[0] += self.seconds
        return results


async def test_a_request_that_cannot_finish_in_time_is_refused_at_the_door() -> None:
    now = [0.0]
    runner = Timed(now, seconds=0.010)
    batcher = Batcher([runner], max_rows=1, budget_s=1.0, clock=lambda: now[0])
    for x in range(WARMUP):  # the drain rate is measured: 10 ms a row
        await submit(batcher, x, deadline=now[0] + 1.0)
    assert batcher.admission.run_s(1) == pytest.approx(0.010)
    runner.gate.clear()
    ahead = [asyncio.create_task(submit(batcher, x, deadline=now[0] + 1.0)) for x in range(5)]
    await settle()  # one runs, four wait: five rows ahead of the next request
    with pytest.raises(Overloaded, match="cannot answer within the deadline"):
        await submit(batcher, 99, deadline=now[0] + 0.055)  # needs ~60 ms
    assert len(batcher.queue) == 4  # refused before it queued
    admitted = asyncio.create_task(submit(batcher, 7, deadline=now[0] + 0.065))
    runner.gate.set()
    assert (await admitted)["y"].tolist() == [14]
    await asyncio.gather(*ahead)
    assert batcher.stats.rejected == 1 and batcher.admission.refused == 1


async def test_an_idle_server_admits_even_a_hopeless_request() -> None:
    """Nothing ahead: the request delays nobody, and its run refreshes the estimate."""
    now = [0.0]
    batcher = Batcher([Timed(now, seconds=0.050)], max_rows=1, clock=lambda: now[0])
    for x in range(WARMUP):
        await submit(batcher, x, deadline=now[0] + 1.0)
    assert (await submit(batcher, 3, deadline=now[0] + 0.001))["y"].tolist() == [6]


async def test_a_request_whose_deadline_would_pass_during_its_run_is_dropped_at_dequeue() -> None:
    now = [0.0]
    runner = Timed(now, seconds=0.010)
    batcher = Batcher([runner], max_rows=1, budget_s=1.0, clock=lambda: now[0])
    for x in range(WARMUP):
        await submit(batcher, x, deadline=now[0] + 1.0)
    runner.gate.clear()
    first = asyncio.create_task(submit(batcher, 1, deadline=now[0] + 1.0))
    await settle()
    late = asyncio.create_task(submit(batcher, 2, deadline=now[0] + 0.025))  # admitted
    await settle()
    now[0] += 0.020  # by the time it could start, 5 ms are left for a 10 ms run
    runner.gate.set()
    await first
    with pytest.raises(DeadlineExpired):
        await late
    assert runner.batches[-1] == [1]  # never ran
    assert batcher.stats.expired == 1


class Affine(Doubler):
    """A batching instance on a fake clock: a run costs 1 ms plus 0.01 ms a row."""

    def __init__(self, now: list[float]) -> None:
        super().__init__()
        self.now = now

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        results = await super().run(batch)
        self.now[0] += 0.001 + 0.00001 * len(batch)
        return results


async def test_a_queue_that_drains_in_batches_is_not_priced_as_runs_of_one() -> None:
    """Warmed on runs of one row (1.01 ms each), a burst of 100 with 20 ms deadlines drains
    in four batches of up to 32 (~4 ms): every request is admitted and answered."""
    now = [0.0]
    runner = Affine(now)
    batcher = Batcher([runner], max_rows=32, budget_s=1.0, clock=lambda: now[0])
    for x in range(WARMUP):
        await submit(batcher, x, deadline=now[0] + 1.0)
    runner.gate.clear()
    burst = [asyncio.create_task(submit(batcher, x, deadline=now[0] + 0.020)) for x in range(100)]
    await settle()
    runner.gate.set()
    results = await asyncio.gather(*burst)
    assert [r["y"].tolist() for r in results] == [[2 * x] for x in range(100)]
    assert batcher.stats.rejected == 0 and batcher.stats.expired == 0


def test_the_run_cost_fit_tells_fixed_from_per_row_seconds() -> None:
    admission = Admission(instances=2, max_rows=8)
    for rows in [1, 8, 4, 2, 8, 1, 6, 3] * 10:
        admission.observe(0.002 + 0.0005 * rows, rows)
    assert admission.fixed_s == pytest.approx(0.002, rel=0.01)
    assert admission.row_s == pytest.approx(0.0005, rel=0.01)
    # 30 one-row requests queued: four runs of 7.5 rows in two waves over two instances
    # (5.75 ms each), then its own run of 2 rows (3 ms).
    ahead = Ahead(queued=30, queued_cost=30, queued_rows=30)
    assert admission.expected_s(ahead, 2) == pytest.approx(2 * 0.00575 + 0.003, rel=0.02)
    # One request of 64 rows running: a run of its own, whatever --max-batch says.
    running = Ahead(busy=1, running_cost=64)
    assert admission.expected_s(running, 1) == pytest.approx(0.034 + 0.0025, rel=0.02)


def test_padded_work_ahead_is_batched_by_rows_and_told_in_positions() -> None:
    """Where inputs are padded, the cost is positions; a batch still takes `max_rows` rows."""
    admission = Admission(instances=1, max_rows=8)
    for positions in [32, 256, 128, 64, 256, 32, 192, 96] * 10:
        admission.observe(0.005 + 0.0001 * positions, positions)
    assert admission.fixed_s == pytest.approx(0.005, rel=0.01)
    # Eight one-row requests of bucket 32 queued: one run of 256 positions (30.6 ms), not
    # eight of 32 (65.6 ms), then its own run of 32 (8.2 ms).
    ahead = Ahead(queued=8, queued_cost=256, queued_rows=8)
    assert admission.expected_s(ahead, 32) == pytest.approx(0.0306 + 0.0082, rel=0.02)
    with pytest.raises(
        Overloaded, match=r"of work for 256 positions ahead and this request's 32, 10.0 ms left"
    ):
        admission.admit(0.0, 0.010, ahead, 32, "positions")


async def test_a_cancelled_waiter_leaves_no_work_ahead_of_others() -> None:
    runner = Doubler()
    runner.gate.clear()
    batcher = Batcher([runner], max_rows=1, budget_s=1.0)
    running = asyncio.create_task(submit(batcher, 0))
    waiting = [asyncio.create_task(submit(batcher, x)) for x in range(1, 4)]
    await settle()
    assert batcher.queue.rows == 3
    for task in waiting:
        task.cancel()
    await settle()
    assert batcher.queue.rows == 0
    runner.gate.set()
    await running
