"""Padding: inputs of different lengths batched. The declaration's checks at load, a
request's lengths and bucket, grouping by bucket, the join rule priced in padded positions,
merge and cut-back (every request gets exactly its own rows and positions back), and a small
masked encoder whose batched answers equal its answers alone."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.core.datatypes import DATATYPES
from sluice.core.errors import InvalidInput, LoadFailed, ModelFailed
from sluice.runtime import tracing
from sluice.server.dataplane import staging
from sluice.server.dataplane.batcher import (
    DRAINED,
    FULL,
    Arrays,
    Batcher,
    BatchQueue,
    Pending,
    Trip,
    cost_of,
)
from sluice.server.dataplane.buffers import BufferPool
from sluice.server.dataplane.engine import TensorSpec
from sluice.server.dataplane.modelsettings import (
    Config,
    ModelSettings,
    parse_buckets,
    parse_pad,
)
from sluice.server.dataplane.padding import (
    DEFAULT_MAX_LENGTH,
    Buckets,
    Padding,
    plan,
    run_lengths,
    tokens,
)
from sluice.server.dataplane.plane import _steps
from sluice.server.dataplane.repository import load_model
from sluice.server.modelconfig import convert, parse
from sluice.server.settings import ServerSettings

DTYPES = [d.dtype.newbyteorder("=") for d in DATATYPES.values()]
SEQ = "sequence"


def spec(name: str, datatype: str, *dims: int | str) -> TensorSpec:
    """A TensorSpec as the engine reads one: a str is a dynamic dimension of that name ("" is
    unnamed)."""
    shape = tuple(None if isinstance(d, str) else d for d in dims)
    names = tuple(d or None if isinstance(d, str) else None for d in dims)
    return TensorSpec(name, datatype, shape, dims=names)


IDS = spec("input_ids", "INT64", "batch", SEQ)
MASK = spec("attention_mask", "INT64", "batch", SEQ)
HIDDEN = spec("hidden", "FP32", "batch", SEQ, 8)
POOLED = spec("pooled", "FP32", "batch", 8)
BOTH = {"input_ids": "0", "attention_mask": "0"}


def text_plan(**kwargs: object) -> Padding:
    found = plan([IDS, MASK], [HIDDEN, POOLED], BOTH, **kwargs)  # type: ignore[arg-type]
    assert found is not None
    return found


def request(length: int, rows: int = 1, mask_length: int | None = None) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.arange(rows * length, dtype=np.int64).reshape(rows, length) + 1,
        "attention_mask": np.ones((rows, mask_length or length), np.int64),
    }


# Buckets


def test_buckets_are_powers_of_two_up_to_the_longest_which_is_the_last() -> None:
    assert [Buckets().of(n) for n in (1, 2, 3, 8, 9, 1000)] == [1, 2, 4, 8, 16, 1024]
    assert Buckets().listed() == () and Buckets().limit == 0
    capped = Buckets(longest=96)
    assert [capped.of(n) for n in (33, 64, 65, 96)] == [64, 64, 96, 96]
    assert capped.of(97) is None
    assert capped.listed() == (1, 2, 4, 8, 16, 32, 64, 96)
    listed = Buckets((16, 32, 128))
    assert [listed.of(n) for n in (1, 16, 17, 100, 128)] == [16, 16, 32, 128, 128]
    assert listed.of(129) is None and listed.limit == 128
    # A longest below the largest listed bucket refuses longer requests; the rest round up.
    short = Buckets((16, 32, 128), longest=100)
    assert short.of(100) == 128 and short.of(101) is None
    assert short.listed() == (16, 32, 128)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 600), unique=True, max_size=6).map(sorted),
    longest=st.integers(0, 700),
    length=st.integers(1, 800),
)
def test_a_length_pads_to_the_least_bucket_that_holds_it(
    sizes: list[int], longest: int, length: int
) -> None:
    if sizes and longest > sizes[-1]:
        longest = sizes[-1]
    buckets = Buckets(tuple(sizes), longest)
    found = buckets.of(length)
    if buckets.limit and length > buckets.limit:
        assert found is None
        return
    assert found is not None and found >= length
    listed = buckets.listed()
    if listed:
        assert found in listed
        assert all(b < length for b in listed if b < found)  # none smaller holds it
    else:
        assert found == 1 << (length - 1).bit_length()


def test_bucket_lists_and_pad_values_are_read_and_refused_in_their_words() -> None:
    assert parse_buckets(" 64, 16,32 ") == (16, 32, 64)
    for text, why in [("16,,32", "'' is not"), ("0", "'0' is not"), ("8,8", "8 is given twice")]:
        with pytest.raises(ValueError, match=why):
            parse_buckets(text)
    assert [parse_pad(t) for t in (" 0", "-1", "0.5", "-inf", "true")] == [
        "0",
        "-1",
        "0.5",
        "-inf",
        "true",
    ]
    with pytest.raises(ValueError, match="pad value 'zero' is not a number"):
        parse_pad("zero")


# The declaration, checked at load


def test_a_plan_pads_the_marked_inputs_and_cuts_the_outputs_along_their_dimension() -> None:
    padding = text_plan(buckets=(16, 32))
    assert padding.dims == (SEQ,)
    assert padding.inputs == {"input_ids": ((1, 0),), "attention_mask": ((1, 0),)}
    assert padding.outputs == {"hidden": ((1, 0),)}  # pooled has no sequence: as it is
    assert padding.values["input_ids"].dtype == np.int64
    assert plan([IDS, MASK], [HIDDEN], {}) is None


@pytest.mark.parametrize(
    ("inputs", "pads", "words"),
    [
        ([IDS, MASK], {"ids": "0"}, "padding is given for input 'ids', which the model does not"),
        (
            [spec("input_ids", "INT64", "batch", 128)],
            {"input_ids": "0"},
            r"input 'input_ids' INT64\[N, 128\] is marked for padding, but it has no dynamic "
            "dimension beyond the batch to pad: dimension 1 is 128",
        ),
        (
            [spec("input_ids", "INT64", "batch", "")],
            {"input_ids": "0"},
            "input 'input_ids' INT64.* its dynamic dimension 1 has no name in the model",
        ),
        (
            [IDS, spec("attention_mask", "INT64", "batch", "seq_len")],
            BOTH,
            "inputs padded together must pad the same dimensions: input 'input_ids' pads "
            "'sequence', input 'attention_mask' pads 'seq_len'",
        ),
        (
            [IDS, MASK],
            {"input_ids": "0"},
            r"input 'attention_mask' INT64\[N, N\] has dimension 1 \('sequence'\), which input "
            "'input_ids' is padded along: mark it for padding too",
        ),
        ([IDS, MASK], {**BOTH, "input_ids": "0.5"}, "input 'input_ids': pad value '0.5' is not a"),
        (
            [spec("ids", "UINT8", "batch", SEQ)],
            {"ids": "300"},
            "input 'ids': pad value 300 is outside UINT8's 0..255",
        ),
        (
            [spec("x", "FP16", "batch", SEQ)],
            {"x": "1e6"},
            "input 'x': pad value '1e6' is beyond FP16",
        ),
        ([spec("b", "BOOL", "batch", SEQ)], {"b": "2"}, "input 'b': pad value '2' is not a BOOL"),
    ],
)
def test_a_declaration_that_does_not_fit_is_refused_at_load_naming_the_input(
    inputs: list[TensorSpec], pads: dict[str, str], words: str
) -> None:
    with pytest.raises(LoadFailed, match=words):
        plan(inputs, [POOLED], pads)


def test_pad_values_take_their_inputs_datatype() -> None:
    specs = [spec(n, t, "batch", SEQ) for n, t in [("b", "BOOL"), ("h", "FP16"), ("i", "INT8")]]
    padding = plan(specs, [], {"b": "true", "h": "-inf", "i": "-128"})
    assert padding is not None
    assert padding.values == {"b": np.True_, "h": np.float16("-inf"), "i": np.int8(-128)}
    assert [v.dtype for v in padding.values.values()] == [np.bool_, np.float16, np.int8]


def test_several_axes_of_one_dimension_pad_together() -> None:
    """A [batch, sequence, sequence] mask pads both axes to the one length."""
    square = spec("mask", "FP32", "batch", SEQ, SEQ)
    padding = plan([IDS, square], [HIDDEN], {"input_ids": "0", "mask": "0"})
    assert padding is not None and padding.inputs["mask"] == ((1, 0), (2, 0))
    good: dict[str, np.ndarray] = {
        "input_ids": np.ones((1, 3), np.int64),
        "mask": np.ones((1, 3, 3), np.float32),
    }
    assert padding.measure(good) == ((3,), (4,))
    with pytest.raises(InvalidInput, match="input 'mask' has length 4 along 'sequence'"):
        padding.measure({**good, "mask": np.ones((1, 3, 4), np.float32)})


# A request's lengths


def test_a_request_is_measured_and_bucketed() -> None:
    padding = text_plan(buckets=(16, 32))
    assert padding.measure(request(5)) == ((5,), (16,))
    assert padding.measure(request(17, rows=3)) == ((17,), (32,))
    assert padding.extent(request(17)) == (17,)


def test_marked_inputs_that_disagree_in_length_are_refused_naming_both() -> None:
    with pytest.raises(
        InvalidInput,
        match=r"input 'attention_mask' has length 7 along 'sequence' \(dimension 1, shape "
        r"\[1, 7\]\) but input 'input_ids' has 5: inputs padded together must agree",
    ):
        text_plan().measure(request(5, mask_length=7))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"buckets": (16, 32)}, "above the longest this model takes, 32 .its largest length"),
        ({"max_length": 30}, "above the longest this model takes, 30$"),
    ],
)
def test_a_request_longer_than_the_longest_is_refused_naming_the_input(
    kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(InvalidInput, match="input 'input_ids' has length 33 along 'sequence', "):
        text_plan(**kwargs).measure(request(33))
    with pytest.raises(InvalidInput, match=words):
        text_plan(**kwargs).measure(request(33))


def test_without_a_longest_or_buckets_lengths_stop_at_the_default_named_in_the_refusal() -> None:
    """Unbounded, every new length would be a new shape (on CUDA a session, kept)."""
    padding = text_plan()
    assert padding.buckets.limit == DEFAULT_MAX_LENGTH == 512
    assert padding.buckets.listed()[-1] == 512  # warm-up runs each of these
    assert padding.measure(request(512))[1] == (512,)
    with pytest.raises(
        InvalidInput,
        match=r"input 'input_ids' has length 700 along 'sequence', above the longest this "
        r"model takes, 512 \(the default: --max-length, or sluice.max_length in its config",
    ):
        padding.measure(request(700))
    # A longest or buckets given, they bound alone.
    assert text_plan(max_length=1000).measure(request(700))[1] == (1000,)
    assert text_plan(buckets=(16, 1024)).measure(request(700))[1] == (1024,)
    help_text = next(
        f.metadata["help"] for f in dataclasses.fields(ServerSettings) if f.name == "max_length"
    )
    assert f"or {DEFAULT_MAX_LENGTH} without them" in help_text


def test_requests_group_within_a_bucket_and_by_their_other_shapes() -> None:
    padding = text_plan(buckets=(16, 32))
    key = padding.group_key
    assert key(request(5), ["pooled"], (16,)) == key(request(16, rows=2), ["pooled"], (16,))
    assert key(request(5), ["pooled"], (16,)) != key(request(17), ["pooled"], (32,))
    assert key(request(5), ["pooled"], (16,)) != key(request(5), ["hidden"], (16,))
    wider = {**request(5), "input_ids": request(5)["input_ids"].astype(np.int32)}
    assert key(request(5), ["pooled"], (16,)) != key(wider, ["pooled"], (16,))


# Merge and cut-back: every request gets exactly its own rows and positions back

Axes = dict[str, tuple[tuple[int, int], ...]]


@st.composite
def padded_batches(
    draw: st.DrawFn,
) -> tuple[list[dict[str, np.ndarray]], list[tuple[int, ...]], Axes, dict[str, np.generic]]:
    """Requests of one group, in a random order: per padded input a dtype, a pad value of
    it, and its axes after the batch, each along padded dimension 0 or 1 or a fixed 2; each
    request its own rows and lengths; and an input "static" that is not padded."""
    dims = draw(st.integers(1, 2))
    names = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True))
    layouts: dict[str, tuple[np.dtype[np.generic], tuple[int, ...]]] = {}
    for name in names:
        layout = draw(st.lists(st.sampled_from([*range(dims), -1]), min_size=1, max_size=3))
        if all(d < 0 for d in layout):
            layout[0] = 0
        layouts[name] = (draw(st.sampled_from(DTYPES)), tuple(layout))
    values = {n: dt.type(draw(hnp.from_dtype(dt))) for n, (dt, _) in layouts.items()}
    axes = {
        n: tuple((i + 1, d) for i, d in enumerate(layout) if d >= 0)
        for n, (_, layout) in layouts.items()
    }
    static = draw(st.sampled_from(DTYPES))
    requests, lengths = [], []
    for _ in range(draw(st.integers(1, 5))):
        rows = draw(st.integers(1, 3))
        own = tuple(draw(st.integers(1, 5)) for _ in range(dims))
        arrays = {
            n: draw(hnp.arrays(dt, (rows, *(own[d] if d >= 0 else 2 for d in layout))))
            for n, (dt, layout) in layouts.items()
        }
        arrays["static"] = draw(hnp.arrays(static, (rows, 3)))
        requests.append(arrays)
        lengths.append(own)
    return requests, lengths, axes, values


@settings(max_examples=150, deadline=None)
@given(padded_batches(), st.booleans())
def test_merge_pads_and_split_cuts_back_each_requests_own_rows_and_positions(
    drawn: tuple[list[dict[str, np.ndarray]], list[tuple[int, ...]], Axes, dict[str, np.generic]],
    to_bucket: bool,
) -> None:
    requests, lengths, axes, values = drawn
    bucket = tuple(max(8, *column) for column in zip(*lengths, strict=True))
    padded = run_lengths(lengths, bucket, to_bucket)
    pads = {n: staging.Pad(tuple((a, padded[d]) for a, d in axes[n]), values[n]) for n in axes}
    pool = BufferPool()
    merged, buffers = staging.merge(requests, pool, 0, None, pads)
    offset = 0
    for sent in requests:
        count = len(sent["static"])
        for name, array in merged.items():
            block = array[offset : offset + count]
            inside = (slice(None), *(slice(0, n) for n in sent[name].shape[1:]))
            assert block[inside].tobytes() == sent[name].tobytes()  # its own values, in place
            if name in pads:
                outside = np.ones(block.shape, bool)
                outside[inside] = False
                pad = np.full(int(outside.sum()), values[name], array.dtype)
                assert block[outside].tobytes() == pad.tobytes()  # the rest: the pad, exactly
        offset += count
    # The merged inputs as a model's outputs: cut back, each request gets what it sent.
    outputs = {name: np.array(array) for name, array in merged.items()}
    for buffer in buffers:
        pool.give(buffer)
    rows = [len(r["static"]) for r in requests]
    back = staging.split(outputs, rows, cuts=axes, lengths=lengths, padded=padded)
    for sent, result in zip(requests, back, strict=True):
        assert result.keys() == sent.keys()
        for name, array in sent.items():
            assert result[name].dtype == array.dtype and result[name].shape == array.shape
            assert result[name].tobytes() == array.tobytes()


def test_a_batch_runs_at_its_bucket_when_staged_else_at_its_longest() -> None:
    assert run_lengths([(3, 9), (5, 2)], (8, 16), to_bucket=False) == (5, 9)
    assert run_lengths([(3, 9)], (8, 16), to_bucket=False) == (3, 9)  # alone: its own
    assert run_lengths([(3, 9), (5, 2)], (8, 16), to_bucket=True) == (8, 16)
    assert tokens(3, (5, 9)) == 135 and tokens(3, ()) == 3


def test_an_output_that_does_not_run_along_the_padding_is_not_cut() -> None:
    out = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="output 'y' has 4 positions in dimension 1 for inputs"):
        staging.split({"y": out}, [1, 2], cuts={"y": ((1, 0),)}, lengths=[(2,), (5,)], padded=(5,))


# The batcher: within a bucket, and only where the padding pays


POWERS = Buckets()


def pending(arrival: float, length: int, rows: int = 1, buckets: Buckets = POWERS) -> Pending:
    bucket = buckets.of(length)
    assert bucket is not None
    return Pending({}, (), rows, ("g", bucket), arrival, lengths=(length,), bucket=(bucket,))


def affine(fixed_s: float, per_token_s: float):  # type: ignore[no-untyped-def]
    return lambda cost: fixed_s + per_token_s * cost


def test_requests_join_a_batch_only_within_their_bucket() -> None:
    queue = BatchQueue(max_rows=8, budget_s=1.0, max_queue=100)
    for t, length in enumerate([5, 20, 7, 8, 30, 3]):
        queue.add(pending(t / 1000, length))
    price = affine(0.001, 0.0)  # all fixed cost: padding is free
    batches = []
    while (taken := queue.take(1.0, price=price)) is not None:
        batches.append([p.lengths[0] for p in taken.batch])
    assert batches == [[5, 7, 8], [20, 30], [3]]


def test_a_request_whose_padding_costs_more_than_it_saves_waits_for_another_batch() -> None:
    """1 ms a position, 2 ms a run whatever its size: a 5 joins a 6 (the run grows by 6 ms
    where the 5 alone takes 7); an 8 after them does not (the run would grow by 12 ms, its
    own 8 positions and 2 more for each of the two; alone it takes 10). Staged runs pad to
    the bucket even alone: there every request joins."""
    queue = BatchQueue(max_rows=8, budget_s=1.0, max_queue=100)
    for t, length in enumerate([6, 5, 8]):
        queue.add(pending(t / 1000, length))
    price = affine(0.002, 0.001)
    first = queue.take(1.0, price=price)
    assert first is not None and [p.lengths for p in first.batch] == [(6,), (5,)]
    second = queue.take(1.0, price=price)
    assert second is not None and [p.lengths for p in second.batch] == [(8,)]
    assert cost_of(first.batch, to_bucket=False) == 12
    staged = BatchQueue(max_rows=8, budget_s=1.0, max_queue=100, to_bucket=True)
    for t, length in enumerate([6, 5, 8]):
        staged.add(pending(t / 1000, length))
    taken = staged.take(1.0, price=price)
    assert taken is not None and len(taken.batch) == 3
    assert cost_of(taken.batch, to_bucket=True) == 24


def test_waiting_requests_of_a_bucket_join_its_batch_however_far_apart_they_arrived() -> None:
    """The budget is 10 ms; the bucket-32 requests arrived 50 ms apart, a bucket-8 one among
    them. All waiting, they form one batch, up to the row limit; exact shapes still close
    on the budget (test_batching)."""
    queue = BatchQueue(max_rows=3, budget_s=0.010, max_queue=100)
    for t, length in enumerate([20, 5, 30, 17, 25]):
        queue.add(pending(t * 0.050, length))
    price = affine(0.001, 0.0)
    first = queue.take(1.0, price=price)
    assert first is not None and first.reason == FULL
    assert [p.lengths[0] for p in first.batch] == [20, 30, 17]
    rest = []
    while (taken := queue.take(1.0, price=price)) is not None:
        rest.append(([p.lengths[0] for p in taken.batch], taken.reason))
    assert rest == [([5], DRAINED), ([25], DRAINED)]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 128), min_size=1, max_size=40),
    rows=st.lists(st.integers(1, 3), min_size=40, max_size=40),
    fixed_ms=st.floats(0.0, 5.0),
    per_token_us=st.floats(0.0, 200.0),
    to_bucket=st.booleans(),
    max_rows=st.integers(1, 16),
    listed=st.booleans(),
)
def test_every_padded_batch_is_one_bucket_and_never_slower_than_its_requests_alone(
    lengths: list[int],
    rows: list[int],
    fixed_ms: float,
    per_token_us: float,
    to_bucket: bool,
    max_rows: int,
    listed: bool,
) -> None:
    buckets = Buckets((16, 48, 128)) if listed else Buckets()
    queue = BatchQueue(max_rows=max_rows, budget_s=1.0, max_queue=1000, to_bucket=to_bucket)
    waiting = [pending(i * 1e-4, n, rows[i], buckets) for i, n in enumerate(lengths)]
    for item in waiting:
        queue.add(item)
    price = affine(fixed_ms / 1000, per_token_us / 1e6)
    seen: list[Pending] = []
    while (taken := queue.take(1.0, price=price)) is not None:
        batch = taken.batch
        assert len({p.bucket for p in batch}) == 1
        assert [p.arrival for p in batch] == sorted(p.arrival for p in batch)
        assert sum(p.rows for p in batch) <= max_rows or len(batch) == 1
        alone = sum(price(cost_of([p], to_bucket)) for p in batch)
        assert price(cost_of(batch, to_bucket)) <= alone + 1e-12
        seen += batch
    assert sorted(id(p) for p in seen) == sorted(id(p) for p in waiting)
    assert queue.rows == 0 and queue.ahead(1) == (0, 0)


class Echo:
    """A fake instance that answers each request with its own inputs, through the queue."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.batches: list[list[tuple[int, ...]]] = []

    def run_inline(
        self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], rows: int
    ) -> Arrays | None:
        return None

    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        self.batches.append([p.lengths for p in batch])
        await self.gate.wait()
        return [dict(p.inputs) for p in batch]


async def test_the_batcher_counts_real_and_padded_positions_and_tells_the_bucket() -> None:
    runner = Echo()
    batcher = Batcher([runner], max_rows=8, budget_s=1.0)
    padding = text_plan(buckets=(16, 32))

    async def submit(length: int, trip: Trip | None = None) -> Arrays:
        inputs = request(length)
        lengths, bucket = padding.measure(inputs)
        group = padding.group_key(inputs, ["pooled"], bucket)
        return await batcher.submit(
            inputs, ["pooled"], rows=1, group=group, trip=trip, lengths=lengths, bucket=bucket
        )

    trips = [Trip() for _ in range(4)]
    tasks = [asyncio.create_task(submit(n, t)) for n, t in zip([3, 10, 12, 20], trips, strict=True)]
    for _ in range(5):  # every task submits: the first runs, three wait
        await asyncio.sleep(0)
    assert len(batcher.queue) == 3
    runner.gate.set()
    answers = await asyncio.gather(*tasks)
    assert [a["input_ids"].shape for a in answers] == [(1, 3), (1, 10), (1, 12), (1, 20)]
    assert runner.batches == [[(3,)], [(10,), (12,)], [(20,)]]
    assert [t.bucket for t in trips] == [16, 16, 16, 32]
    stats = batcher.stats
    assert stats.real_tokens == 3 + 10 + 12 + 20
    assert stats.padded_tokens == 3 + 2 * 12 + 20  # the pair runs at its longest, 12
    assert stats.padding_efficiency == pytest.approx(45 / 47)
    assert stats.by_bucket == {(16,): 2, (32,): 1}


class Failing(Echo):
    async def run(self, batch: Sequence[Pending]) -> list[Arrays]:
        raise ModelFailed("no")


async def test_positions_are_counted_once_run_with_the_rows_the_run_padded() -> None:
    """A failed run counts nothing; runs that pad their rows (staged) count those rows."""
    padding = text_plan(buckets=(16, 32))

    async def submit(batcher: Batcher, length: int) -> Arrays:
        inputs = request(length)
        lengths, bucket = padding.measure(inputs)
        group = padding.group_key(inputs, ["pooled"], bucket)
        return await batcher.submit(
            inputs, ["pooled"], rows=1, group=group, lengths=lengths, bucket=bucket
        )

    failing = Batcher([Failing()], max_rows=8, budget_s=1.0)
    with pytest.raises(ModelFailed):
        await submit(failing, 5)
    assert (failing.stats.real_tokens, failing.stats.padded_tokens) == (0, 0)
    assert not failing.stats.by_bucket

    runner = Echo()
    batcher = Batcher([runner], max_rows=8, budget_s=1.0)
    batcher.queue.to_bucket = batcher.pad_rows = True
    tasks = [asyncio.create_task(submit(batcher, n)) for n in (3, 10, 12, 5)]
    for _ in range(5):  # every task submits: the first runs, three wait
        await asyncio.sleep(0)
    runner.gate.set()
    await asyncio.gather(*tasks)
    assert runner.batches == [[(3,)], [(10,), (12,), (5,)]]
    assert batcher.stats.real_tokens == 3 + 10 + 12 + 5
    assert batcher.stats.padded_tokens == 16 + 4 * 16  # three rows run as four, at the bucket


def test_a_padded_batch_span_names_its_bucket(spans: InMemorySpanExporter) -> None:
    """The batch run's span carries the bucket of a padded request; an unpadded one none."""
    for bucket in (64, None):
        trip = Trip()
        trip.ran(taken=1.0, started=1.0, ended=1.5, rows=2, requests=2, reason="full")
        trip.bucket = bucket
        _steps(trip, lambda: 2.0)
    padded, plain = [s for s in spans.get_finished_spans() if s.name == tracing.BATCH_RUN]
    assert padded.attributes is not None and plain.attributes is not None
    assert padded.attributes[tracing.BATCH_BUCKET] == 64
    assert tracing.BATCH_BUCKET not in plain.attributes


# A small masked encoder, served


def encoder(
    *,
    vocab: int = 50,
    hidden: int = 8,
    pooled_only: bool = False,
    hidden_dim: str = SEQ,
    doubled: bool = False,
) -> bytes:
    """A masked self-attention encoder with seeded weights: input_ids and attention_mask
    INT64 [batch, sequence]; outputs hidden FP32 [batch, sequence, hidden] (token embedding,
    one attention whose padded keys get -1e9, residual, LayerNormalization) and pooled FP32
    [batch, hidden], the mean over the real positions; `pooled_only`: pooled alone.
    `hidden_dim`: the name hidden's sequence dimension has; `doubled`: an output `twice`
    too, hidden twice along the sequence [batch, 2 x sequence, hidden]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    weights = {
        "E": rng.normal(0, 1, (vocab, hidden)),
        **{w: rng.normal(0, 1, (hidden, hidden)) / np.sqrt(hidden) for w in ("Wq", "Wk", "Wv")},
        "gamma": rng.normal(1, 0.1, hidden),
        "beta": rng.normal(0, 0.1, hidden),
        "scale": np.array(1 / np.sqrt(hidden)),
        "one": np.array(1.0),
        "masked": np.array(-1e9),
    }
    initializers = [
        numpy_helper.from_array(np.asarray(w, np.float32), n) for n, w in weights.items()
    ]
    for name, axis in [("axis1", 1), ("axis2", 2)]:
        initializers.append(numpy_helper.from_array(np.array([axis], np.int64), name))
    node = helper.make_node
    nodes = [
        node("Gather", ["E", "input_ids"], ["emb"]),
        node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        node("MatMul", ["emb", "Wq"], ["q"]),
        node("MatMul", ["emb", "Wk"], ["k"]),
        node("MatMul", ["emb", "Wv"], ["v"]),
        node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        node("MatMul", ["q", "kt"], ["s0"]),
        node("Mul", ["s0", "scale"], ["s1"]),
        node("Sub", ["one", "m"], ["off"]),
        node("Mul", ["off", "masked"], ["keys"]),
        node("Unsqueeze", ["keys", "axis1"], ["keys3"]),
        node("Add", ["s1", "keys3"], ["s2"]),
        node("Softmax", ["s2"], ["p"], axis=-1),
        node("MatMul", ["p", "v"], ["ctx"]),
        node("Add", ["emb", "ctx"], ["h"]),
        node("LayerNormalization", ["h", "gamma", "beta"], ["hidden"], axis=-1, epsilon=1e-5),
        node("Unsqueeze", ["m", "axis2"], ["m3"]),
        node("Mul", ["hidden", "m3"], ["hm"]),
        node("ReduceSum", ["hm", "axis1"], ["total"], keepdims=0),
        node("ReduceSum", ["m", "axis1"], ["count"], keepdims=1),
        node("Div", ["total", "count"], ["pooled"]),
    ]
    info = helper.make_tensor_value_info
    inputs = [
        info("input_ids", TensorProto.INT64, ["batch", SEQ]),
        info("attention_mask", TensorProto.INT64, ["batch", SEQ]),
    ]
    outputs = [info("pooled", TensorProto.FLOAT, ["batch", hidden])]
    if not pooled_only:
        outputs.insert(0, info("hidden", TensorProto.FLOAT, ["batch", hidden_dim, hidden]))
    if doubled:
        nodes.append(node("Concat", ["hidden", "hidden"], ["twice"], axis=1))
        outputs.append(info("twice", TensorProto.FLOAT, ["batch", "twice_dim", hidden]))
    graph = helper.make_graph(nodes, "encoder", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what the installed ONNX Runtime reads
    return bytes(model.SerializeToString())


def texts(lengths: Sequence[int], vocab: int = 50, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "input_ids": rng.integers(1, vocab, (1, n)).astype(np.int64),
            "attention_mask": np.ones((1, n), np.int64),
        }
        for n in lengths
    ]


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    """Within 1e-5 of the answer alone, relative to its largest magnitude."""
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name, pooled_only in [("encoder", False), ("pooled", True)]:
        paths[name] = tmp_path / f"{name}.onnx"
        paths[name].write_bytes(encoder(pooled_only=pooled_only))
    return paths


PADDED = ModelSettings(
    device="cpu", max_batch=16, batch_budget_s=1.0, inline_max_s=0.0, intra_op_threads=1, pads=BOTH
)


async def gathered(model: object, requests: Sequence[Mapping[str, np.ndarray]]) -> list[Arrays]:
    """The requests sent at once: the first runs alone, the rest wait and batch."""
    runs = [model.run(r, [], None) for r in requests]  # type: ignore[attr-defined]
    return [answer for answer, _ in await asyncio.gather(*runs)]


@pytest.mark.parametrize("name", ["encoder", "pooled"])
async def test_batched_answers_equal_the_answers_alone(models: dict[str, Path], name: str) -> None:
    model = await load_model(name, 1, models[name], PADDED)
    try:
        assert "pads input_ids with 0, attention_mask with 0 along sequence" in model.describe()
        requests = texts([5, 7, 8, 3, 12, 16, 9, 30, 1, 6, 7, 13])
        alone = [(await model.run(r, [], None))[0] for r in requests]
        batches = model.batcher.stats.batches
        together = await gathered(model, requests)
        assert model.batcher.stats.batches - batches < len(requests)  # some shared a run
        for want, got in zip(alone, together, strict=True):
            assert got.keys() == want.keys()
            for output in want:
                assert_close(got[output], want[output])
        stats = model.batcher.stats
        assert (
            stats.padded_tokens
            > stats.real_tokens
            == 2 * sum(r["input_ids"].size for r in requests)
        )
    finally:
        await model.close()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=2, max_size=12), st.integers(0, 2**16))
def test_random_lengths_and_orders_get_their_own_answers(
    models_once: dict[str, Path], lengths: list[int], seed: int
) -> None:
    async def check() -> None:
        model = await load_model("encoder", 1, models_once["encoder"], PADDED)
        try:
            requests = texts(lengths, seed=seed)
            alone = [(await model.run(r, [], None))[0] for r in requests]
            for want, got in zip(alone, await gathered(model, requests), strict=True):
                for output in want:
                    assert_close(got[output], want[output])
        finally:
            await model.close()

    asyncio.run(check())


async def test_an_output_along_the_length_under_another_name_is_cut_back_too(
    tmp_path: Path,
) -> None:
    """Exports that name their inputs' axes only name an output's on their own: warm-up
    learns from two runs which of its axes follow the padded length."""
    path = tmp_path / "exported.onnx"
    path.write_bytes(encoder(hidden_dim="Addlast_hidden_state_dim_1"))
    model = await load_model("exported", 1, path, PADDED)
    try:
        requests = texts([5, 12, 3, 9])
        alone = [(await model.run(r, [], None))[0] for r in requests]
        for want, got in zip(alone, await gathered(model, requests), strict=True):
            assert_close(got["hidden"], want["hidden"])
        assert model.padding is not None and model.padding.outputs["hidden"] == ((1, 0),)
    finally:
        await model.close()


async def test_an_output_that_changes_with_the_length_but_is_not_it_is_refused_at_load(
    tmp_path: Path,
) -> None:
    path = tmp_path / "doubled.onnx"
    path.write_bytes(encoder(doubled=True))
    with pytest.raises(LoadFailed, match=r"output 'twice' dimension 1 is 4 long .* 2 .* 8 .* 4"):
        await load_model("doubled", 1, path, PADDED)


@pytest.fixture(scope="module")
def models_once(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    path = tmp_path_factory.mktemp("padding") / "encoder.onnx"
    path.write_bytes(encoder())
    return {"encoder": path}


async def test_staged_runs_pad_to_the_bucket_and_cut_back(models: dict[str, Path]) -> None:
    """As on CUDA: every batch, a request alone too, is staged and run at its bucket."""
    from sluice.server.dataplane.engine import Engine
    from sluice.server.dataplane.models import Model
    from sluice.server.dataplane.repository import warm_up

    engine = Engine(models["encoder"], device="cpu", stage=True, max_batch=8, lengths=True)
    try:
        model = Model(
            engine, Batcher(engine.instances, max_rows=8, budget_s=1.0), pads=BOTH, buckets=(8, 32)
        )
        warm_up(model)
        requests = texts([3, 8, 20, 5, 31, 2])
        alone = [(await model.run(r, [], None))[0] for r in requests]
        for want, got in zip(alone, await gathered(model, requests), strict=True):
            for output in want:
                assert_close(got[output], want[output])
        stats = model.batcher.stats
        assert set(stats.by_bucket) == {(8,), (32,)}
        # Alone or not, each run ran its bucket's positions, on rows padded to a power of
        # two: alone six runs; together the first alone, 8, 5 and 2 (as four rows), 20 and 31.
        alone_tokens = sum(8 if n <= 8 else 32 for n in [3, 8, 20, 5, 31, 2])
        assert stats.padded_tokens == alone_tokens + 8 + 4 * 8 + 2 * 32
    finally:
        engine.close()


def unbatched() -> bytes:
    """input_ids INT64 [1, sequence] (no batch dimension to share); outputs doubled FP32
    [1, sequence], total FP32 [] (the ids' sum) and pair FP32 [2] (the sum twice)."""
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node
    nodes = [
        node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT),
        node("Mul", ["f", "two"], ["doubled"]),
        node("ReduceSum", ["f"], ["total"], keepdims=0),
        node("Reshape", ["total", "one"], ["total1"]),
        node("Concat", ["total1", "total1"], ["pair"], axis=0),
    ]
    initializers = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "unbatched",
        [info("input_ids", TensorProto.INT64, [1, SEQ])],
        [
            info("doubled", TensorProto.FLOAT, [1, SEQ]),
            info("total", TensorProto.FLOAT, []),
            info("pair", TensorProto.FLOAT, [2]),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


async def test_a_staged_request_alone_is_cut_back_without_splitting_rows(tmp_path: Path) -> None:
    """As on CUDA, a model without a batch dimension: its outputs of a static first dimension
    other than 1, or of none, come back whole; those along the length, cut back."""
    from sluice.server.dataplane.engine import Engine
    from sluice.server.dataplane.models import Model
    from sluice.server.dataplane.repository import warm_up

    path = tmp_path / "unbatched.onnx"
    path.write_bytes(unbatched())
    engine = Engine(path, device="cpu", stage=True, max_batch=1, lengths=True)
    try:
        model = Model(engine, Batcher(engine.instances), pads={"input_ids": "0"}, buckets=(8,))
        warm_up(model)
        ids = np.array([[3, 1, 4, 1, 5]], np.int64)
        answer, _ = await model.run({"input_ids": ids}, [], None)
        assert answer["doubled"].tolist() == [[6.0, 2.0, 8.0, 2.0, 10.0]]
        assert answer["total"].shape == () and float(answer["total"]) == 14.0
        assert answer["pair"].tolist() == [14.0, 14.0]
        assert model.batcher.stats.padded_tokens == 8  # it ran at its bucket
    finally:
        engine.close()


async def test_bad_requests_are_refused_naming_the_input_and_leave_the_rest_be(
    models: dict[str, Path],
) -> None:
    model = await load_model("encoder", 1, models["encoder"], replace_max(PADDED, 16))
    try:
        good = texts([4, 6, 9, 15])
        alone = [(await model.run(r, [], None))[0] for r in good]
        bad = [
            (
                {**good[0], "attention_mask": np.ones((1, 5), np.int64)},
                "'attention_mask' has length 5",
            ),
            (texts([17])[0], "input 'input_ids' has length 17 along 'sequence', above the longest"),
            ({"input_ids": good[0]["input_ids"]}, "missing input 'attention_mask'"),
        ]
        calls = [model.run(r, [], None) for r in good[:2]]
        calls += [model.run(r, [], None) for r, _ in bad]
        calls += [model.run(r, [], None) for r in good[2:]]
        results = await asyncio.gather(*calls, return_exceptions=True)
        answers = results[:2] + results[-2:]
        for want, got in zip(alone, answers, strict=True):
            assert not isinstance(got, BaseException)
            for output in want:
                assert_close(got[0][output], want[output])
        for (_, words), refused in zip(bad, results[2:-2], strict=True):
            assert isinstance(refused, InvalidInput) and words in str(refused)
    finally:
        await model.close()


def replace_max(settings: ModelSettings, longest: int) -> ModelSettings:
    from dataclasses import replace

    return replace(settings, max_length=longest)


@pytest.mark.parametrize(
    ("pads", "words"),
    [
        ({"input_ids": "0"}, "input 'attention_mask' INT64\\[N, N\\] has dimension 1"),
        ({**BOTH, "attention_mask": "1.5"}, "input 'attention_mask': pad value '1.5' is not a"),
    ],
)
async def test_a_model_whose_declaration_does_not_fit_is_refused_at_load(
    models: dict[str, Path], pads: dict[str, str], words: str
) -> None:
    from dataclasses import replace

    with pytest.raises(LoadFailed, match=words):
        await load_model("encoder", 1, models["encoder"], replace(PADDED, pads=pads))


# Settings and config


def test_pad_flags_reach_the_model_they_name() -> None:
    settings = ServerSettings(
        model=["a=a.onnx", "b=b.onnx"],
        pad=["a:input_ids=0", "a:attention_mask=0", "b:x:0=-1"],
        buckets="32,16",
        max_length=24,
    )
    a, b = settings.model_settings("a"), settings.model_settings("b")
    assert a.pads == BOTH and b.pads == {"x:0": "-1"}
    assert a.buckets == b.buckets == (16, 32) and a.max_length == 24
    assert settings.model_settings().pads == {}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"pad": ["input_ids"]}, "--pad takes \\[MODEL:\\]INPUT=VALUE, not 'input_ids'"),
        ({"pad": ["input_ids=zero"]}, "--pad 'input_ids=zero': pad value 'zero' is not a number"),
        ({"pad": ["x=0", "x=1"]}, "--pad gives input 'x' a value twice"),
        ({"buckets": "16,x"}, "--buckets '16,x': length bucket 'x' is not a positive"),
        ({"buckets": "16,32", "max_length": 64}, "--max-length 64: the longest length 64 is above"),
        ({"model": [], "model_repository": "repo", "pad": ["x=0"]}, "--pad is for --model"),
    ],
)
def test_bad_pad_flags_are_refused_at_start(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ServerSettings(**{"model": ["m.onnx"], **kwargs})  # type: ignore[arg-type]


CONFIG = """
max_batch_size: 16
parameters { key: "sluice.pad.input_ids" value: { string_value: "0" } }
parameters { key: "sluice.pad.attention_mask" value: { string_value: " 0 " } }
parameters { key: "sluice.buckets" value: { string_value: "16,32,64,128" } }
parameters { key: "sluice.max_length" value: { string_value: "100" } }
"""


def test_a_config_declares_padding_buckets_and_the_longest() -> None:
    config = convert(parse(CONFIG))
    assert config.pads == BOTH
    assert config.buckets == (16, 32, 64, 128) and config.max_length == 100
    served = ModelSettings(max_length=512).overlay(config)
    assert served.pads == BOTH and served.max_length == 100
    # Buckets alone bring their own longest: the largest, not the server's --max-length.
    alone = Config(buckets=(16, 32))
    assert ModelSettings(max_length=512).overlay(alone).max_length == 0


@pytest.mark.parametrize(
    ("parameter", "words"),
    [
        ('"sluice.pad.x" value: { string_value: "zero" }', "parameter 'sluice.pad.x' \\(input"),
        ('"sluice.pad." value: { string_value: "0" }', "'sluice.pad.' names no input"),
        ('"sluice.buckets" value: { string_value: "0" }', "parameter 'sluice.buckets': length"),
        ('"sluice.max_length" value: { string_value: "-3" }', "'sluice.max_length': '-3' is not"),
    ],
)
def test_a_config_whose_padding_does_not_parse_is_refused(parameter: str, words: str) -> None:
    with pytest.raises(LoadFailed, match=words):
        convert(parse(f"parameters {{ key: {parameter} }}"))


async def test_each_rows_and_bucket_shape_gets_a_session_of_its_own_where_sessions_are_made(
    models: dict[str, Path],
) -> None:
    """On CUDA each (rows, bucket) shape has a session of its own, made on its first run (a
    session re-plans whenever its input shape changes). Engine makes them on CUDA only; here
    the factory is handed in, and counts what it makes."""
    import onnxruntime as ort

    from sluice.server.dataplane.engine import Engine, Instance

    engine = Engine(models["encoder"], device="cpu", stage=True, max_batch=4, lengths=True)
    try:
        made: list[int] = []

        def spill() -> ort.InferenceSession:
            made.append(1)
            return ort.InferenceSession(str(models["encoder"]), providers=["CPUExecutionProvider"])

        base = engine.instances[0]
        instance = Instance(
            0,
            base.session,
            pool=engine.pool,
            executor=engine.executor,
            output_specs=engine.outputs,
            stage_always=True,
            batchable=True,
            spill=spill,
        )
        instance.padding = text_plan(buckets=(8, 32))
        requests = texts([3, 5, 20, 7])
        for sizes in ([0], [0, 1], [2], [0, 1, 3], [2]):
            batch = []
            for i in sizes:
                lengths, bucket = instance.padding.measure(requests[i])
                batch.append(
                    Pending(requests[i], ("pooled",), 1, "g", 0.0, lengths=lengths, bucket=bucket)
                )
            await instance.run(batch)
        # Rows padded to powers of two: (1, 8), (2, 8), (1, 32), (4, 8); (1, 32) again reused.
        assert sorted(k for k in instance.by_rows if isinstance(k, tuple)) == [
            (1, (8,)),
            (1, (32,)),
            (2, (8,)),
            (4, (8,)),
        ]
        assert len(made) == 4
    finally:
        engine.close()
