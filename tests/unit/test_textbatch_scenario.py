"""The variable-length text scenario's arithmetic (perf/textbatch_figures.py, for
perf/textbatch.py): the lengths drawn, the requests and their padding, ONNX Runtime alone's
three plans, a window's figures, the medians, the answers' comparison, the goals and the
table. Nothing is started and no timing is judged: the server figures below are made up."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from perf import make_text
from perf import textbatch_figures as tf


# perf/make_text.py's graph, small: a whole vocabulary (the ids drawn fit it), 16 wide.
def tiny() -> bytes:
    return make_text.build(hidden=16, heads=2, layers=1, max_length=16)


INPUTS = [
    tf.Input("input_ids", np.int64),
    tf.Input("attention_mask", np.int64),
    tf.Input("token_type_ids", np.int32),
]


def test_lengths_are_seeded_skewed_and_within_bounds() -> None:
    sizes = tf.lengths(1024)
    assert sizes == tf.lengths(1024) and sizes != tf.lengths(1024, seed=1)
    assert min(sizes) == tf.LOW and max(sizes) == tf.HIGH
    assert statistics.median(sizes) <= 32  # most short
    assert 0 < sum(n == tf.HIGH for n in sizes) < 40  # a tail to the longest
    assert sum(n > 64 for n in sizes) > 50
    assert max(tf.lengths(100, high=40)) == 40


def test_requests_fill_ids_masks_and_types_by_name() -> None:
    reqs = tf.requests(INPUTS, [3, 9])
    assert [r["input_ids"].shape for r in reqs] == [(1, 3), (1, 9)]
    one = reqs[1]
    assert one["attention_mask"].dtype == np.int64 and (one["attention_mask"] == 1).all()
    assert one["token_type_ids"].dtype == np.int32 and (one["token_type_ids"] == 0).all()
    assert ((one["input_ids"] >= tf.IDS[0]) & (one["input_ids"] < tf.IDS[1])).all()
    assert all(
        np.array_equal(a["input_ids"], b["input_ids"])
        for a, b in zip(reqs, tf.requests(INPUTS, [3, 9]), strict=True)
    )


def test_the_text_inputs_of_a_model_and_the_refusal_of_others() -> None:
    run = tf.session(tiny(), 1)
    assert tf.text_inputs(run) == [
        tf.Input("input_ids", np.int64),
        tf.Input("attention_mask", np.int64),
        tf.Input("token_type_ids", np.int64),
    ]
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "floats",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(ValueError, match=r"input 'x' is tensor\(float\)"):
        tf.text_inputs(tf.session(model.SerializeToString(), 1))


def test_pads_parsed_checked_and_defaulted() -> None:
    assert tf.parse_pads([], INPUTS) == {"input_ids": 0, "attention_mask": 0, "token_type_ids": 0}
    assert tf.parse_pads(["input_ids=-1", "attention_mask=0"], INPUTS) == {
        "input_ids": -1,
        "attention_mask": 0,
    }
    with pytest.raises(ValueError, match="NAME=INTEGER"):
        tf.parse_pads(["input_ids"], INPUTS)
    with pytest.raises(ValueError, match="NAME=INTEGER"):
        tf.parse_pads(["input_ids=0.5"], INPUTS)
    with pytest.raises(ValueError, match="no input 'ids'"):
        tf.parse_pads(["ids=0"], INPUTS)


def test_padded_rows_keep_their_values_and_fill_the_rest() -> None:
    rows = tf.requests(INPUTS, [2, 5])
    batch = tf.padded(rows, 8, {"input_ids": 7, "attention_mask": 0})
    assert batch["input_ids"].shape == (2, 8) and batch["token_type_ids"].dtype == np.int32
    assert np.array_equal(batch["input_ids"][0, :2], rows[0]["input_ids"][0])
    assert (batch["input_ids"][0, 2:] == 7).all() and (batch["input_ids"][1, 5:] == 7).all()
    assert batch["attention_mask"].sum() == 7  # the real tokens
    assert (batch["token_type_ids"] == 0).all()  # not in pads: 0


def test_buckets_are_powers_of_two_up_to_the_top() -> None:
    assert [tf.bucket(n) for n in (1, 2, 3, 8, 9, 16, 17, 100, 128)] == [
        1,
        2,
        4,
        8,
        16,
        16,
        32,
        128,
        128,
    ]
    assert tf.bucket(70, top=100) == 100


@given(st.lists(st.integers(tf.LOW, tf.HIGH), min_size=1, max_size=200))
def test_every_plan_runs_each_request_once_within_its_length(sizes: list[int]) -> None:
    for name in tf.PLANS:
        batches = tf.plan(name, sizes)
        members = [i for b in batches for i in b.members]
        assert sorted(members) == list(range(len(sizes)))
        for b in batches:
            assert 1 <= len(b.members) <= tf.ROWS
            assert all(sizes[i] <= b.length for i in b.members)
        efficiency = tf.efficiency(batches, sizes)
        assert 0 < efficiency <= 1
    one = tf.plan("one-by-one", sizes)
    assert [b.length for b in one] == sizes and tf.efficiency(one, sizes) == 1
    for b in tf.plan("padded-to-longest", sizes):
        assert b.members == tuple(range(b.members[0], b.members[-1] + 1))  # arrival order
        assert b.length == max(sizes[i] for i in b.members)
    bucketed = tf.plan("bucketed", sizes)
    for b in bucketed:
        assert {tf.bucket(sizes[i]) for i in b.members} == {b.length}
        assert list(b.members) == sorted(b.members)
    # at most one part-full batch a bucket
    part_full = Counter(b.length for b in bucketed if len(b.members) < tf.ROWS)
    assert max(part_full.values(), default=0) <= 1
    assert tf.efficiency(bucketed, sizes) > 0.5  # a power of two wastes less than half


def test_an_unknown_plan_is_refused() -> None:
    with pytest.raises(ValueError, match="no plan 'sorted'"):
        tf.plan("sorted", [8])


def test_ort_alone_runs_whole_passes_of_its_plan() -> None:
    run = tf.session(tiny(), 1)
    sizes = [8, 3, 16, 5]
    reqs = tf.requests(tf.text_inputs(run), sizes)
    figures = tf.ort_alone(run, tf.plan("bucketed", sizes, top=16), reqs, {}, 0.0)
    assert figures["rows"] == 4 and figures["rows_per_s"] > 0 and figures["cpu_ms_per_row"] >= 0


def test_a_window_figures_its_calls_cpu_batches_and_tokens() -> None:
    times = [0.010] * 98 + [0.050, 0.100]
    closed = {"full": 1, "budget": 20, "drained": 4}
    w = tf.window(times, 2.0, 1, 0.5, 0.1, (25, 100), (3000.0, 4000.0), 0.2, closed)
    assert w["calls"] == 100 and w["errors"] == 1 and w["rows_per_s"] == 50
    assert w["p50"] == pytest.approx(10.0) and 50 < w["p99"] < 100
    assert w["server_cpu_ms_per_row"] == pytest.approx(5.0)
    assert w["client_cpu_ms_per_row"] == pytest.approx(1.0)
    assert w["model_ms_per_row"] == pytest.approx(2.0) and w["closed_by"] == closed
    assert (w["batches"], w["batched_requests"], w["mean_batch"]) == (25, 100, 4.0)
    assert w["padding_efficiency"] == 0.75
    bare = tf.window([], 1.0, 3, 0.0, 0.0, None, None)
    assert bare["rows_per_s"] == 0 and bare["p50"] is None and bare["mean_batch"] is None
    assert bare["padding_efficiency"] is None and bare["server_cpu_ms_per_row"] is None
    assert bare["model_ms_per_row"] is None and bare["closed_by"] is None


def window(rows_per_s: float, mean_batch: float | None = None) -> dict[str, Any]:
    closed = {"full": 0, "budget": 7, "drained": 3} if mean_batch else None
    w = tf.window([0.01], 1.0, 0, 0.001, 0.0, None, None, None, closed)
    return {**w, "rows_per_s": rows_per_s, "mean_batch": mean_batch, "batches": 10}


def test_summaries_take_the_median_of_the_rounds() -> None:
    runs = {
        "single": [window(300), window(100), window(200)],
        "batched": [window(400, 4.0), window(500, 3.0)],
    }
    cells = tf.summarize(runs)
    assert cells["single"]["rows_per_s"] == 200 and cells["single"]["mean_batch"] is None
    assert cells["single"]["rounds_rows_per_s"] == [300, 100, 200]
    assert cells["single"]["calls"] == 3 and cells["single"]["batches"] == 30
    assert cells["batched"]["mean_batch"] == 3.5 and cells["batched"]["batched_requests"] is None
    assert cells["batched"]["closed_by"] == {"full": 0, "budget": 14, "drained": 6}
    assert cells["single"]["closed_by"] is None
    ort_runs = {"bucketed": [{"rows_per_s": 1.0, "cpu_ms_per_row": 3.0, "rows": 5.0}] * 2}
    assert tf.ort_summary(ort_runs) == {"bucketed": {"rows_per_s": 1.0, "cpu_ms_per_row": 3.0}}


def test_answers_compare_relative_to_the_largest_magnitude() -> None:
    want = [{"h": np.array([[100.0, 0.001]], np.float32), "p": np.ones((1, 2), np.float32)}]
    near = [{"h": want[0]["h"] + np.float32(5e-4), "p": want[0]["p"]}]
    checked = tf.compare(near, want)
    assert checked["equal"] and checked["checked"] == 1
    assert checked["worst"]["h"] == pytest.approx(5e-6, rel=1e-2) and checked["worst"]["p"] == 0
    far = [{"h": want[0]["h"], "p": want[0]["p"] * 1.001}]
    assert tf.compare(far, want)["differ"] == [0]
    uncut = [{"h": np.zeros((1, 4), np.float32), "p": want[0]["p"]}]  # not cut back
    assert tf.compare(uncut, want)["worst"]["h"] == float("inf")
    assert not tf.compare([{"h": want[0]["h"]}], want)["equal"]  # an output missing
    assert tf.relative(np.zeros((1, 0)), np.zeros((1, 0))) == 0


def sweeps(single: float, batched: float, mean_batch: float) -> dict[str, Any]:
    cells = tf.summarize({"single": [window(single)], "batched": [window(batched, mean_batch)]})
    cells["batched"]["batched_requests"] = 400
    return cells


def test_the_goals_judge_rows_per_second_mean_batch_and_answers() -> None:
    ort_figures = {"bucketed": {"rows_per_s": 500.0, "cpu_ms_per_row": 2.0}}
    answers = {
        "checked": 64,
        "worst": {"h": 0.0, "p": 2e-7},
        "differ": [],
        "equal": True,
        "batches": 9,
    }
    met = tf.goals(sweeps(300, 460, 4.0), ort_figures, answers)
    assert [g["result"] for g in met] == ["PASS"] * 4
    assert [g["measured"] for g in met] == [pytest.approx(460 / 300), 0.92, 4.0, 2e-7]
    assert met[2]["floor"] == "400 requests in 10 batches"
    assert met[3]["floor"] == "64 requests in 9 batches, 0 differ"
    missed = tf.goals(sweeps(300, 290, 2.0), ort_figures, {**answers, "equal": False})
    assert [g["result"] for g in missed] == ["MISS"] * 4
    unknown = sweeps(300, 460, 4.0)
    unknown["batched"]["mean_batch"] = None
    assert tf.goals(unknown, ort_figures, answers)[2]["result"] == "n/a"


def test_the_table_has_a_row_per_configuration_and_goal() -> None:
    sizes = [8, 16, 128]
    plans = {name: tf.plan(name, sizes) for name in tf.PLANS}
    cells = sweeps(300, 460, 4.0)
    cells["unpadded"] = cells["single"]
    ort_figures = {name: {"rows_per_s": 500.0, "cpu_ms_per_row": 2.0} for name in tf.PLANS}
    answers = {"checked": 2, "worst": {"h": 0.0}, "differ": [], "equal": True, "batches": 1}
    labels = {name: f"row {name}" for name in ("single", "unpadded", "batched", *tf.PLANS)}
    result = {
        "command": "python -m perf.textbatch",
        "context": {
            "commit": "abc",
            "started": "now",
            "cpus": 2,
            "loadavg_before": [1.0],
            "loadavg_after": [2.0],
            "note": "",
        },
        "rounds": 3,
        "seconds": 10.0,
        "callers": 16,
        "threads": 1,
        "lengths": sizes,
        "labels": labels,
        "sweeps": cells,
        "ort_alone": ort_figures,
        "ort_mean_batch": {n: len(sizes) / len(p) for n, p in plans.items()},
        "ort_efficiency": {n: tf.efficiency(p, sizes) for n, p in plans.items()},
        "goals": tf.goals(cells, ort_figures, answers),
    }
    table = tf.markdown(result)
    assert "3 requests of 8-128 tokens (median 16, mean 50.7)" in table
    for label in labels.values():
        assert f"| {label} |" in table
    assert "| row padded-to-longest | 500 | 3.00 | 0.40 |" in table
    assert "| row bucketed | 500 | 1.00 | 1.00 | - | - | 2.000 (ORT) | 2.000 | - | - |" in table
    assert table.count("**PASS**") == 4 and "| 0.0e+00 | 1e-05 |" in table
