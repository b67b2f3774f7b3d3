"""The scheduler between requests and model instances: a batch-of-one fast path when an
instance is idle, and an SLO-aware micro-batcher when all are busy (docs/DESIGN.md, "Batching
policy"). Transport-free; the clock is injected.

A padded request joins a batch only if the longer run costs no more than running it alone. A
free instance waits for more of a padded bucket only while another instance runs, never past
the budget or a waiting deadline. A request that cannot finish in time is refused before it
queues (admission) or dropped before its run; a cancelled caller leaves its batch-mates be.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from sluice.core.errors import DeadlineExpired, Overloaded
from sluice.core.tenants import PRIORITIES
from sluice.server.dataplane.admission import Admission, Ahead
from sluice.server.dataplane.buffers import bucket
from sluice.server.dataplane.padding import Lengths, label, run_lengths, tokens

Arrays = dict[str, np.ndarray]
FULL, BUDGET, DRAINED = "full", "budget", "drained"
PASSED = "the deadline passed while the request waited"
WOULD_PASS = "the deadline would pass before the request's run could end; dropped unrun"
SHED = (
    "overloaded: shed from a full queue for more urgent work (a higher priority class); "
    "retry later or elsewhere"
)


class Trip:
    """What the batcher tells a caller that passes one to `submit` (tracing does): when the
    request arrived and left the queue, and the batch it ran in. Plain facts, times on the
    batcher's clock; a caller that passes none costs the batcher nothing but a None check."""

    __slots__ = (
        "arrival",
        "bucket",
        "ended",
        "inline",
        "reason",
        "requests",
        "rows",
        "started",
        "taken",
    )

    def __init__(self) -> None:
        self.arrival = 0.0
        self.taken: float | None = None  # out of the queue (None: never, e.g. cancelled)
        self.started = 0.0  # its batch's run began
        self.ended = 0.0  # ... and ended (or failed)
        self.rows = 0  # the batch's rows, all its requests together
        self.requests = 0  # the batch's requests (0: it ran in none, e.g. it expired)
        self.reason = ""  # why the batch closed: full, budget or drained
        self.inline = False  # the fast path: run alone on the caller's thread, unqueued
        # The length bucket of a padded request, as a span attribute: the length (one padded
        # dimension), or the lengths joined by "x"; None unpadded.
        self.bucket: int | str | None = None

    def ran(
        self, taken: float, started: float, ended: float, rows: int, requests: int, reason: str
    ) -> None:
        self.taken, self.started, self.ended = taken, started, ended
        self.rows, self.requests, self.reason = rows, requests, reason


@dataclass(eq=False)
class Pending:
    """One request waiting for, or in, a batch."""

    inputs: Mapping[str, np.ndarray]
    outputs: tuple[str, ...]
    rows: int
    group: Hashable  # requests batch together only within a group
    arrival: float
    deadline: float | None = None  # absolute, on the batcher's clock
    future: asyncio.Future[Arrays] | None = None
    taken: bool = False  # out of the queue: in a batch, or abandoned
    trip: Trip | None = None  # the caller asked what happens to the request (tracing)
    priority: int = 0  # its class: 0 is served first (sluice.core.tenants)
    # A padded request's lengths along the padded dimensions, and the bucket they round up
    # to (its group's); both empty unpadded.
    lengths: Lengths = ()
    bucket: Lengths = ()

    @property
    def abandoned(self) -> bool:
        return self.future is not None and self.future.done()

    @property
    def cost(self) -> int:
        """What its run counts as in the cost model: its rows padded to its bucket (rows
        where nothing is padded)."""
        return tokens(self.rows, self.bucket)


@dataclass
class Taken:
    batch: list[Pending]
    reason: str
    expired: list[Pending] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.batch)


def padded_to(batch: Sequence[Pending], to_bucket: bool) -> Lengths:
    """The lengths a batch runs at (padding.run_lengths): () where nothing is padded."""
    return run_lengths([p.lengths for p in batch], batch[0].bucket, to_bucket)


def cost_of(batch: Sequence[Pending], to_bucket: bool) -> int:
    """A batch's run in the cost model's units: its rows times the lengths it runs at."""
    return tokens(sum(p.rows for p in batch), padded_to(batch, to_bucket))


class BatchQueue:
    """The waiting requests and the batch-forming rule; pure and synchronous.

    Requests wait by priority class (0 first: sluice.core.tenants' interactive, then
    batch): a batch is formed from the highest class that has a request waiting, so a
    flood of lower-class work delays higher-class calls by at most the runs already going.
    A full queue makes room for a higher-class request by shedding the newest request of the
    lowest class below it.

    `to_bucket`: padded batches run at their bucket's lengths (on CUDA, where each new shape
    is a re-plan), not at the longest request's."""

    def __init__(
        self, *, max_rows: int, budget_s: float, max_queue: int, to_bucket: bool = False
    ) -> None:
        self.max_rows = max_rows
        self.budget_s = budget_s
        self.max_queue = max_queue
        self.to_bucket = to_bucket
        self.rows = 0  # rows waiting
        self.size = 0  # requests in the queues (abandoned ones until a batch skips them)
        self._classes: list[deque[Pending]] = [deque() for _ in PRIORITIES]
        self._rows = [0] * len(PRIORITIES)  # rows waiting by class
        self._costs = [0] * len(PRIORITIES)  # and their cost (Pending.cost)

    def __len__(self) -> int:
        return self.size

    def ahead(self, priority: int) -> tuple[int, int]:
        """Requests, and their cost (Pending.cost: rows where nothing is padded), that would
        run before a new request of `priority`."""
        queues = self._classes[: priority + 1]
        return sum(map(len, queues)), sum(self._costs[: priority + 1])

    def rows_ahead(self, priority: int) -> int:
        """The rows of the requests `ahead` counts."""
        return sum(self._rows[: priority + 1])

    def add(self, item: Pending) -> Pending | None:
        """Queue `item`; the request shed to make room for it, if one was (its caller must
        be told). Overloaded when the queue is full of work at least as urgent."""
        shed = None
        if len(self) >= self.max_queue:
            shed = self._shed_below(item.priority)
            if shed is None:
                raise Overloaded(
                    f"overloaded: the request queue is full ({self.max_queue} waiting); "
                    "retry later or elsewhere"
                )
        self._classes[item.priority].append(item)
        self._rows[item.priority] += item.rows
        self._costs[item.priority] += item.cost
        self.rows += item.rows
        self.size += 1
        return shed

    def _shed_below(self, priority: int) -> Pending | None:
        for cls in range(len(self._classes) - 1, priority, -1):  # the least urgent first
            if self._classes[cls]:
                item = self._classes[cls].pop()
                self.size -= 1
                self.forget(item)
                return item
        return None

    def forget(self, item: Pending) -> None:
        """A waiting request was abandoned: its rows no longer count as work ahead."""
        if not item.taken:
            item.taken = True
            self.rows -= item.rows
            self._rows[item.priority] -= item.rows
            self._costs[item.priority] -= item.cost

    def take(
        self,
        now: float,
        run_s: Callable[[float], float] | None = None,
        price: Callable[[float], float] | None = None,
    ) -> Taken | None:
        """The next batch, from the most urgent class with a request waiting, with the
        requests of that class (and the ones before it) that expired on the way (or would
        expire before a run of theirs, `run_s(cost)` seconds, could answer them); None when
        empty. `price(cost)`: a run's seconds, by which a padded request joins a batch only
        if that costs no more than its run alone."""
        expired: list[Pending] = []
        for cls in range(len(self._classes)):
            taken = self._take(cls, now, run_s, price, expired)
            if taken is not None:
                return taken
        return Taken([], DRAINED, expired) if expired else None

    def _take(
        self,
        cls: int,
        now: float,
        run_s: Callable[[float], float] | None,
        price: Callable[[float], float] | None,
        expired: list[Pending],
    ) -> Taken | None:
        batch: list[Pending] = []
        keep: deque[Pending] = deque()
        reason = DRAINED
        rows = 0
        peak: Lengths = ()  # the batch's longest lengths, padded ones
        closed = False
        for item in self._classes[cls]:
            if item.abandoned or item.taken:
                continue
            if item.deadline is not None and item.deadline <= now + (
                run_s(item.cost) if run_s is not None else 0.0
            ):
                expired.append(item)
                continue
            if closed:
                keep.append(item)
                continue
            if not batch:
                batch.append(item)
                rows, peak = item.rows, item.lengths
                continue
            oldest = batch[0]
            if item.group != oldest.group:
                keep.append(item)
            elif not item.bucket and item.arrival > oldest.arrival + self.budget_s:
                reason, closed = BUDGET, True
                keep.append(item)
            elif rows + item.rows > self.max_rows:
                reason, closed = FULL, True
                keep.append(item)
            elif item.bucket and price is not None and not self._pays(rows, peak, item, price):
                keep.append(item)  # its padding would cost more than it saves: later, or alone
            else:
                batch.append(item)
                rows += item.rows
                if item.bucket:
                    peak = tuple(map(max, peak, item.lengths))
        self.size += len(keep) - len(self._classes[cls])
        self._classes[cls] = keep
        kept = cost = 0
        for item in keep:  # one pass; an unpadded request costs its rows
            kept += item.rows
            cost += item.cost if item.bucket else item.rows
        self.rows += kept - self._rows[cls]
        self._rows[cls] = kept
        self._costs[cls] = cost
        for item in batch:
            item.taken = True
        if not batch:
            return None
        if rows >= self.max_rows:
            reason = FULL
        return Taken(batch, reason, expired)

    def hold(self, now: float, run_s: Callable[[float], float]) -> float | None:
        """Until when a free instance, with another running, should wait for the oldest's
        padded batch to grow; None: take it now (unpadded, full, or no time left to wait).
        `run_s(cost)`: a run's seconds, by which no waiting request's deadline is waited past."""
        oldest: Pending | None = None
        rows = cost = 0
        deadline = float("inf")
        for queue in self._classes:  # the most urgent class with a live request, as `take`
            live = [p for p in queue if not (p.taken or p.abandoned)]
            if not live:
                continue
            oldest = live[0]
            if not oldest.bucket:
                return None
            for item in live:
                if item.group == oldest.group:
                    rows += item.rows
                    cost += item.cost
                if item.deadline is not None:
                    deadline = min(deadline, item.deadline)
            break
        if oldest is None or rows >= self.max_rows:
            return None
        until = min(oldest.arrival + self.budget_s, deadline - run_s(cost))
        return until if until > now else None

    def _pays(
        self, rows: int, peak: Lengths, item: Pending, price: Callable[[float], float]
    ) -> bool:
        """Whether `item` joining a batch of `rows` rows whose longest lengths are `peak`
        lengthens its run (padding.run_lengths) by no more than `item`'s run alone takes."""
        bucket = item.bucket if self.to_bucket else None
        before = tokens(rows, bucket or peak)
        after = tokens(rows + item.rows, bucket or tuple(map(max, peak, item.lengths)))
        return price(after) - price(before) <= price(tokens(item.rows, bucket or item.lengths))


class Runner(Protocol):
    """A model instance: runs one batch at a time, returns outputs per request in order."""

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]: ...

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        """Run one request now, on the caller's thread, if this instance's runs are tiny
        enough for that; None otherwise."""


@dataclass
class BatcherStats:
    batches: int = 0
    requests: int = 0  # run in batches
    rows: int = 0
    flushes: Counter[str] = field(default_factory=Counter)  # full, budget, drained
    rejected: int = 0  # refused at the door: queue full, or no time to answer
    expired: int = 0  # deadline passed while waiting
    # Padded requests: the positions they hold, and those their runs ran, padding included.
    real_tokens: int = 0
    padded_tokens: int = 0
    by_bucket: Counter[Lengths] = field(default_factory=Counter)  # padded batches by bucket

    @property
    def mean_batch(self) -> float:
        return self.requests / self.batches if self.batches else 0.0

    @property
    def padding_efficiency(self) -> float:
        """Real positions over those run (1: no padding ran; 0 before any padded run)."""
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


class Batcher:
    def __init__(
        self,
        runners: Sequence[Runner],
        *,
        max_rows: int = 1,
        budget_s: float = 0.005,
        max_queue: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not runners:
            raise ValueError("at least one runner")
        self.queue = BatchQueue(max_rows=max_rows, budget_s=budget_s, max_queue=max_queue)
        self.clock = clock
        self.stats = BatcherStats()
        self.admission = Admission(len(runners), max_rows)
        self._idle = list(runners)
        self.busy = 0  # runners with a batch
        self._running_cost = 0  # their cost (cost_of): rows where nothing is padded
        self.runs = Counter[int]()  # batches per runner index
        self._index = {id(r): i for i, r in enumerate(runners)}
        self._tasks: set[asyncio.Task[None]] = set()
        # A free instance holding for a bigger padded batch (BatchQueue.hold) looks again
        # at `_wake`, on the batcher's clock.
        self._timer: asyncio.TimerHandle | None = None
        self._wake = 0.0
        # Metrics hooks, None (nothing done per request) unless an exporter sets them:
        # each request's seconds in the queue (0 on the fast path), and each model run's
        # rows and wall seconds.
        self.on_wait: Callable[[float], None] | None = None
        self.on_run: Callable[[int, float], None] | None = None
        # The runners pad a batch's rows to a power of two (staged engines: models.Model
        # sets it), so a padded batch's positions run count those rows too.
        self.pad_rows = False

    async def submit(
        self,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        *,
        rows: int,
        group: Hashable,
        deadline: float | None = None,
        trip: Trip | None = None,
        priority: int = 0,
        lengths: Lengths = (),
        bucket: Lengths = (),
    ) -> Arrays:
        """Run one request; raises Overloaded when the queue is full or the request cannot
        be answered before its deadline, DeadlineExpired when its deadline passes first.
        A `trip` is filled in with the request's queue wait and batch as they happen. The
        work ahead of it is the runs going and the queued requests of its `priority` class
        and more urgent ones (lower numbers). A padded request gives its `lengths` and their
        `bucket` (its `group` holds the bucket too)."""
        now = self.clock()
        if trip is not None:
            trip.arrival = now
            trip.bucket = label(bucket)
        if deadline is not None and not (self._idle and not self.queue.size):
            # Admission prices work in the cost model's units: rows, padded to their bucket
            # where padded (Pending.cost); it counts the batches by rows.
            queued, queued_cost = self.queue.ahead(priority)
            queued_rows = self.queue.rows_ahead(priority)
            ahead = Ahead(self.busy, self._running_cost, queued, queued_cost, queued_rows)
            unit = "positions" if bucket else "rows"
            try:
                self.admission.admit(now, deadline, ahead, tokens(rows, bucket), unit)
            except Overloaded:
                self.stats.rejected += 1
                raise
        if self._idle and not self.queue.size:
            # The fast path: an idle instance whose runs are tiny answers right here, with
            # no future, task or extra trip round the event loop.
            runner = self._idle[-1]
            result = runner.run_inline(inputs, outputs, rows)
            if result is not None:
                ended = self.clock()
                took = ended - now
                if trip is not None:
                    trip.ran(now, now, ended, rows, 1, DRAINED)
                    trip.inline = True
                ran = tokens(rows, lengths) if lengths else rows  # alone: nothing padded
                self.admission.observe(took, ran)
                self._count(runner, [rows], DRAINED)
                if bucket:
                    self._padded(bucket, ran, ran)
                if self.on_run is not None:
                    self.on_run(rows, took)
                if self.on_wait is not None:
                    self.on_wait(0.0)
                return result
        future: asyncio.Future[Arrays] = asyncio.get_running_loop().create_future()
        item = Pending(
            inputs,
            tuple(outputs),
            rows,
            group,
            now,
            deadline,
            future,
            trip=trip,
            priority=priority,
            lengths=lengths,
            bucket=bucket,
        )
        try:
            shed = self.queue.add(item)
        except Overloaded:
            self.stats.rejected += 1
            raise
        if shed is not None:
            self.stats.rejected += 1
            _fail(shed, Overloaded(SHED))
        # A caller that gives up (its deadline, a cancel) leaves no work ahead of others.
        future.add_done_callback(lambda done: self.queue.forget(item) if done.cancelled() else None)
        self._pump()
        return await future

    def _pump(self) -> None:
        while self._idle and self.queue.size:
            # A lone request on an idle server runs even if it may end late, as at the door.
            contended = self.busy > 0 or self.queue.size > 1
            now = self.clock()
            run_s = self.admission.run_s
            if self.busy and (until := self.queue.hold(now, run_s)) is not None:
                self._look_again(now, until)
                return
            taken = self.queue.take(now, run_s if contended else None, run_s)
            if taken is None:
                return
            if self.on_wait is not None:
                for item in taken.batch:
                    self.on_wait(now - item.arrival)
            for item in taken.expired:
                self.stats.expired += 1
                passed = item.deadline is not None and item.deadline <= now
                if item.trip is not None:
                    item.trip.taken = now
                _fail(item, DeadlineExpired(PASSED if passed else WOULD_PASS))
            if not taken.batch:
                continue
            runner = self._idle.pop()  # the most recently used: its memory is warm
            self.busy += 1
            cost = cost_of(taken.batch, self.queue.to_bucket)
            self._running_cost += cost
            self._count(runner, [p.rows for p in taken.batch], taken.reason)
            task = asyncio.create_task(self._run(runner, taken, now, cost))
            self._tasks.add(task)  # held until done: a task nobody holds can be collected
            task.add_done_callback(self._tasks.discard)

    def _look_again(self, now: float, until: float) -> None:
        if self._timer is not None and self._wake <= until:
            return  # already due no later
        if self._timer is not None:
            self._timer.cancel()
        self._wake = until
        self._timer = asyncio.get_running_loop().call_later(until - now, self._woken)

    def _woken(self) -> None:
        self._timer = None
        self._pump()

    def _count(self, runner: Runner, rows: list[int], reason: str) -> None:
        self.stats.batches += 1
        self.stats.requests += len(rows)
        self.stats.rows += sum(rows)
        self.stats.flushes[reason] += 1
        self.runs[self._index[id(runner)]] += 1

    def _padded(self, bucket: Lengths, real: int, ran: int) -> None:
        self.stats.real_tokens += real
        self.stats.padded_tokens += ran
        self.stats.by_bucket[bucket] += 1

    async def _run(self, runner: Runner, taken: Taken, at: float, cost: int) -> None:
        """Run a batch taken from the queue at `at`, of `cost` (cost_of); answer each of its
        waiters."""
        batch, rows, reason = taken.batch, taken.rows, taken.reason
        started = self.clock()
        try:
            results = await runner.run(batch)
        except Exception as exc:  # every waiter must hear of the failure
            ended = self.clock()
            for item in batch:
                if item.trip is not None:
                    item.trip.ran(at, started, ended, rows, len(batch), reason)
                _fail(item, exc)
        else:
            ended = self.clock()
            took = ended - started
            self.admission.observe(took, cost)
            if batch[0].bucket:  # what ran, once it ran: padding rows too where runs pad them
                real = sum(tokens(p.rows, p.lengths) for p in batch)
                run_rows = bucket(rows) if self.pad_rows else rows
                ran = tokens(run_rows, padded_to(batch, self.queue.to_bucket))
                self._padded(batch[0].bucket, real, ran)
            if self.on_run is not None:
                self.on_run(rows, took)
            for item, result in zip(batch, results, strict=True):
                if item.trip is not None:  # told before its waiter wakes
                    item.trip.ran(at, started, ended, rows, len(batch), reason)
                if item.future is not None and not item.future.done():
                    item.future.set_result(result)
        finally:
            self.busy -= 1
            self._running_cost -= cost
            self._idle.append(runner)
            self._pump()

    async def close(self) -> None:
        """Wait for running batches to finish."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _fail(item: Pending, exc: BaseException) -> None:
    if item.future is not None and not item.future.done():
        item.future.set_exception(exc)
