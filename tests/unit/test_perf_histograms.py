"""The sweep's statistics: percentiles, merging across processes, knee detection, and the
open-loop schedule."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.perf import histograms
from sluice.perf.loadgen import Bodies, closed_loop, open_loop
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

T = TypeVar("T")


@pytest.mark.parametrize(
    "samples_s",
    [
        np.random.default_rng(1).uniform(0.0001, 0.1, 50_000),
        np.random.default_rng(2).exponential(0.002, 50_000) + 0.0002,
        np.random.default_rng(3).lognormal(np.log(0.001), 1.0, 50_000),
    ],
    ids=["uniform", "exponential", "lognormal"],
)
def test_percentiles_match_the_distribution(samples_s: np.ndarray) -> None:
    histogram = histograms.new_histogram()
    for s in samples_s:
        histograms.record(histogram, float(s))
    summary = histograms.summarize(histogram)
    micros = np.floor(samples_s * 1e6)
    assert summary.count == len(samples_s)
    for got, q in ((summary.p50, 50), (summary.p90, 90), (summary.p99, 99), (summary.p999, 99.9)):
        # Within 3 significant digits of a sample whose rank is within 0.01% of q.
        low = float(np.percentile(micros, q - 0.01, method="lower")) / 1000
        high = float(np.percentile(micros, q + 0.01, method="higher")) / 1000
        assert low * (1 - 1e-3) <= got <= high * (1 + 1e-3), q
    assert summary.max == pytest.approx(micros.max() / 1000, rel=1e-3)
    assert summary.min == pytest.approx(micros.min() / 1000, rel=1e-3)


@settings(max_examples=25, deadline=None)  # each encode/decode of a histogram takes ~20 ms
@given(st.lists(st.floats(1e-6, 100.0), min_size=1, max_size=300), st.integers(1, 5))
def test_merge_across_processes_equals_one_histogram(values: list[float], parts: int) -> None:
    whole = histograms.new_histogram()
    pieces = [histograms.new_histogram() for _ in range(parts)]
    for i, v in enumerate(values):
        histograms.record(whole, v)
        histograms.record(pieces[i % parts], v)
    merged = histograms.merge([p.encode() for p in pieces])
    assert histograms.summarize(merged) == histograms.summarize(whole)


def test_values_out_of_range_are_clamped_not_dropped() -> None:
    histogram = histograms.new_histogram()
    histograms.record(histogram, 0.0)
    histograms.record(histogram, 10_000.0)
    assert histogram.get_total_count() == 2


@pytest.mark.parametrize(
    ("throughput", "p99", "knee"),
    [
        ([100, 200, 400, 800], [1, 1.1, 1.2, 1.5], None),  # still scaling
        ([100, 200, 400, 410], [1, 1.1, 1.2, 1.5], 2),  # throughput flattens
        ([100, 200, 400, 800], [1, 1.1, 2.5, 3.0], 1),  # p99 more than doubles
        ([100, 90, 80], [1, 1, 1], 0),  # overload from the start
        ([100], [1], None),
    ],
)
def test_knee(throughput: list[float], p99: list[float], knee: int | None) -> None:
    assert histograms.find_knee(throughput, p99) == knee


def test_unique_bodies_differ_and_still_parse() -> None:
    x = np.zeros((1, 64), np.float32)
    body = pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString()
    raw = codec.encode("input", x).raw_data
    bodies = Bodies((body,), unique_offset=body.rindex(raw), unique_datatype="FP32")
    numbers = [*range(2000), *(10**12 + k for k in range(50)), 10**15]
    seen = {bodies.body(k) for k in numbers}
    assert len(seen) == len(numbers)
    decoded = codec.decode(pb.PredictRequest.FromString(bodies.body(1234)).inputs[0])
    assert decoded[0, :3].tolist() == pytest.approx([3.4, 1.2, 0.0])
    assert len(bodies.body(7)) == len(body)


class VirtualClock:
    """Seconds that pass only when the event loop below has nothing to do."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class JumpingSelector(selectors.DefaultSelector):
    """Never waits: when no I/O is ready, the clock jumps to the end of the wait instead."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only another thread can wake the loop
            return super().select(None)
        self.clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a VirtualClock: asyncio.sleep takes no real time, and every time the
    code under test reads is exact however loaded the machine. For code without I/O."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(JumpingSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


def on_virtual_time(main: Callable[[VirtualClock], Coroutine[Any, Any, T]]) -> T:
    clock = VirtualClock()
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(clock)) as runner:
        return runner.run(main(clock))


class SerialServer:
    """A fake target that answers one call at a time, in arrival order; the first call takes
    `slow_s`, the others `fast_s`."""

    def __init__(self, slow_s: float, fast_s: float) -> None:
        self.lock = asyncio.Lock()
        self.slow_s, self.fast_s = slow_s, fast_s
        self.calls = 0

    async def call(self, body: bytes) -> str:
        async with self.lock:
            self.calls += 1
            await asyncio.sleep(self.slow_s if self.calls == 1 else self.fast_s)
        return "OK"


def test_open_loop_keeps_to_its_schedule() -> None:
    server = SerialServer(slow_s=0.001, fast_s=0.001)
    result = on_virtual_time(
        lambda clock: open_loop(
            server.call, Bodies((b"",)), rate=200, total=0, duration=1.0, clock=clock
        )
    )
    summary = histograms.summarize(histograms.merge([result.histogram]))
    assert result.statuses == {"OK": 200}  # rate x duration calls
    # Sent every 5 ms, the last at 995 ms, each answered in 1 ms: never faster, never later.
    assert result.wall_s == pytest.approx(0.996)
    assert result.max_outstanding == 1
    assert summary.min == pytest.approx(1.0, abs=0.002)
    assert summary.max == pytest.approx(1.0, abs=0.002)


def test_open_loop_latency_includes_the_wait_behind_a_slow_response() -> None:
    server = SerialServer(slow_s=0.2, fast_s=0.001)
    result = on_virtual_time(
        lambda clock: open_loop(
            server.call, Bodies((b"",)), rate=100, total=20, duration=0, clock=clock
        )
    )
    summary = histograms.summarize(histograms.merge([result.histogram]))
    assert result.statuses == {"OK": 20}
    # Arrivals kept to the schedule (every 10 ms) rather than waiting on the slow call: all
    # 20 were out before its answer at 200 ms, and the last was answered at 219 ms...
    assert result.max_outstanding == 20
    assert result.wall_s == pytest.approx(0.219)
    # ...and each call queued behind it counts the wait from its scheduled send time: call k
    # (sent at 10k ms, answered at 200 + k ms) took 200 - 9k ms, from 191 ms down to 29 ms.
    assert summary.max == pytest.approx(200, abs=0.5)
    assert summary.min == pytest.approx(29, abs=0.5)
    assert summary.p50 == pytest.approx(110, abs=0.5)


def test_closed_loop_hides_that_wait_which_is_why_open_loop_exists() -> None:
    server = SerialServer(slow_s=0.2, fast_s=0.001)
    result = on_virtual_time(
        lambda clock: closed_loop(
            server.call, Bodies((b"",)), concurrency=1, total=20, duration=0, clock=clock
        )
    )
    summary = histograms.summarize(histograms.merge([result.histogram]))
    assert result.statuses == {"OK": 20}
    assert result.wall_s == pytest.approx(0.219)  # the same calls in the same time...
    assert summary.p50 == pytest.approx(1, abs=0.01)  # ...but only one call saw the stall
    assert summary.max == pytest.approx(200, abs=0.5)
