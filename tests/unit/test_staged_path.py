"""The staged path, which CUDA with pinned memory always takes (pooled staging buffers, IO
binding, batches padded to the pool's power-of-two row counts), forced on the CPU so that CI
covers it without a GPU: models with and without a batch dimension, errors, padding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from sluice import models
from sluice.core.errors import InvalidInput, ModelFailed
from sluice.server.dataplane import staging
from sluice.server.dataplane.batcher import Batcher, Pending
from sluice.server.dataplane.engine import Engine, Instance, _run_error
from sluice.server.dataplane.models import Model
from sluice.server.dataplane.repository import warm_up
from tests.conftest import SAMPLES, scale_model


def _model(path: Path, nodes: list[onnx.NodeProto], inputs: list, outputs: list) -> Path:
    graph = helper.make_graph(nodes, path.stem, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())
    return path


def _fp32(name: str, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("staged")


@pytest.fixture(scope="module")
def fixed(folder: Path) -> Path:
    """No batch dimension anywhere: FP32[4] in, y = 2x FP32[4] and its sum FP32[1] out."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    return _model(
        folder / "fixed.onnx",
        [
            helper.make_node("Constant", [], ["k"], value=two),
            helper.make_node("Mul", ["x", "k"], ["y"]),
            helper.make_node("ReduceSum", ["x"], ["total"], keepdims=1),
        ],
        [_fp32("x", [4])],
        [_fp32("y", [4]), _fp32("total", [1])],
    )


@pytest.fixture(scope="module")
def reduced(folder: Path) -> Path:
    """A batch dimension in, none out: FP32[N, 4] summed over the rows to FP32[4]."""
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    return _model(
        folder / "reduced.onnx",
        [
            helper.make_node("Constant", [], ["axes"], value=axes),
            helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=0),
        ],
        [_fp32("x", ["N", 4])],
        [_fp32("total", [4])],
    )


@pytest.fixture(scope="module")
def sum_model(folder: Path) -> Path:
    """Two batched inputs: FP32[N, 4] a + b."""
    return _model(
        folder / "pair.onnx",
        [helper.make_node("Add", ["a", "b"], ["sum"])],
        [_fp32("a", ["N", 4]), _fp32("b", ["N", 4])],
        [_fp32("sum", ["N", 4])],
    )


def staged(path: Path) -> Iterator[Engine]:
    engine = Engine(path, device="cpu", stage=True)
    yield engine
    engine.close()


async def _run(engine: Engine, requests: list[dict[str, np.ndarray]]) -> list[dict]:
    outputs = tuple(s.name for s in engine.outputs)
    batch = [Pending(r, outputs, len(next(iter(r.values()))), "g", 0.0) for r in requests]
    return await engine.instances[0].run(batch)


def _expect(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


async def test_batches_are_padded_to_the_pools_sizes_and_split_back_exactly(
    reference: ort.InferenceSession,
) -> None:
    engine = Engine(models.DIGITS, device="cpu", stage=True, instances=1)
    try:
        assert engine.staged and engine.batchable and engine.instances[0].pad
        assert engine.warm_rows(64) == [1, 2, 4, 8, 16, 32, 64]
        assert engine.warm_rows(5) == [1, 2, 4, 8]
        rows = np.concatenate([s.input for s in SAMPLES])
        parts = [rows[0:1], rows[1:4], rows[4:6]]  # 6 rows, run as 8
        for _ in range(2):  # the second time from pooled buffers, padding rows reused
            results = await _run(engine, [{"input": p} for p in parts])
            for part, result in zip(parts, results, strict=True):
                label, probabilities = reference.run(None, {"input": part})
                np.testing.assert_array_equal(result["label"], label)
                np.testing.assert_array_equal(result["probabilities"], probabilities)
        stats = engine.pool.stats()
        assert stats.reused >= 1
        assert stats.buffers >= 1  # given back, every one
        alone = await _run(engine, [{"input": parts[1]}])  # 3 rows, run as 4
        np.testing.assert_array_equal(
            alone[0]["label"], reference.run(["label"], {"input": parts[1]})[0]
        )
        assert alone[0]["probabilities"].base is None  # a copy: the pooled buffer went back
    finally:
        engine.close()


async def test_a_model_without_a_batch_dimension(fixed: Path) -> None:
    for engine in staged(fixed):
        assert engine.staged and not engine.batchable
        assert engine.warm_rows(64) == [1]
        x = np.arange(4, dtype=np.float32)
        for _ in range(2):
            (result,) = await _run(engine, [{"x": x}])
            np.testing.assert_array_equal(result["y"], 2 * x)
            np.testing.assert_array_equal(result["total"], [6.0])


async def test_a_batch_in_and_none_out(reduced: Path) -> None:
    for engine in staged(reduced):
        assert not engine.batchable  # the output has no batch: requests never share a run
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        (result,) = await _run(engine, [{"x": x}])
        np.testing.assert_array_equal(result["total"], _expect(reduced, {"x": x})["total"])
        assert result["total"].shape == (4,)


async def test_every_input_is_staged_and_bound_alive(sum_model: Path) -> None:
    """Two inputs given as strided views: each is staged (or made contiguous) and stays
    alive while ONNX Runtime reads it."""
    for engine in staged(sum_model):
        base = np.arange(48, dtype=np.float32).reshape(6, 8)
        a, b = base[:, ::2], base[:, 1::2]  # not contiguous
        want = a + b
        results = await _run(engine, [{"a": a[:2], "b": b[:2]}, {"a": a[2:], "b": b[2:]}])
        np.testing.assert_array_equal(np.concatenate([r["sum"] for r in results]), want)
        got, pooled = engine.instances[0].run_sync({"a": a, "b": b}, ["sum"], 6)
        np.testing.assert_array_equal(got["sum"], want)
        for buffer in pooled:
            engine.pool.give(buffer)


def test_io_binding_errors_map_like_session_runs() -> None:
    """run_with_iobinding reports a misfit input as a bare RuntimeError; it is still the
    caller's INVALID_ARGUMENT, as session.run's InvalidArgument is."""
    engine = Engine(models.DIGITS, device="cpu", stage=True)
    try:
        wrong = np.zeros((2, 63), np.float32)
        with pytest.raises(InvalidInput, match="Got invalid dimensions for input"):
            engine.instances[0].run_sync({"input": wrong}, ["label"], 2, pooled_inputs=True)
        assert engine.pool.stats().buffers >= 1  # its output buffer went back
    finally:
        engine.close()


async def test_warm_up_takes_each_instances_staging_buffers_once_and_pools_full_batches() -> None:
    """Warm-up runs every padded size through each instance as requests run, so the buffers
    (pinned, on a GPU: slow to allocate) wait in the pool; a full batch's buffers are kept
    even where they exceed the pool's usual largest share."""
    engine = Engine(
        models.DIGITS, device="cpu", stage=True, instances=2, max_batch=8, pool_bytes=16 << 10
    )
    try:
        assert engine.pool.max_buffer_bytes == 8 * 64 * 4  # a full batch's input, not 1 KiB
        model = Model(engine, Batcher(engine.instances, max_rows=8, budget_s=0.0))
        warm_up(model)
        warmed = engine.pool.stats()
        # 4 sizes x 2 instances x (input, label, probabilities), all back in the pool.
        assert (warmed.allocated, warmed.buffers, warmed.dropped) == (24, 24, 0)
        rows = np.concatenate([s.input for s in SAMPLES])[:8]
        results = await _run(engine, [{"input": rows[:5]}, {"input": rows[5:]}])
        assert [len(r["label"]) for r in results] == [5, 3]
        after = engine.pool.stats()
        assert after.allocated == warmed.allocated  # served from the warmed buffers
        assert after.reused == 3
    finally:
        engine.close()


async def test_each_padded_size_runs_on_its_own_session_where_given(folder: Path) -> None:
    """On CUDA a session re-plans whenever its input shape changes, so each padded batch size
    has a session of its own (Engine gives them on CUDA only; here they are handed in). The
    sessions scale by different factors, so the answers tell which one ran."""
    paths = {}
    for factor in (2.0, 3.0, 5.0):
        paths[factor] = folder / f"scale{factor:g}.onnx"
        paths[factor].write_bytes(scale_model(factor))
    engine = Engine(paths[2.0], device="cpu", stage=True, max_batch=4)
    try:
        three = ort.InferenceSession(str(paths[3.0]), providers=["CPUExecutionProvider"])
        made: list[int] = []

        def spill() -> ort.InferenceSession:
            made.append(1)
            return ort.InferenceSession(str(paths[5.0]), providers=["CPUExecutionProvider"])

        base = engine.instances[0]
        instance = Instance(
            0,
            base.session,
            pool=engine.pool,
            executor=engine.executor,
            output_specs=engine.outputs,
            stage_always=True,
            batchable=True,
            by_rows={4: three},
            spill=spill,
        )
        x = np.ones((1, 4), np.float32)
        (alone,) = await instance.run([Pending({"x": x}, ("y",), 1, "g", 0.0)])
        np.testing.assert_array_equal(alone["y"], 2 * x)  # size 1: the instance's session
        assert made == []  # the spill session is made only when first needed
        batch = [Pending({"x": x}, ("y",), 1, "g", 0.0) for _ in range(3)]  # padded to 4
        for result in await instance.run(batch):
            np.testing.assert_array_equal(result["y"], 3 * x)
        for _ in range(2):  # 6 rows, padded to 8: larger than any size with a session
            large = [Pending({"x": x}, ("y",), 1, "g", 0.0) for _ in range(6)]
            for result in await instance.run(large):
                np.testing.assert_array_equal(result["y"], 5 * x)
        assert made == [1]
    finally:
        engine.close()


async def test_an_output_whose_first_dimension_is_not_the_batch_is_refused(folder: Path) -> None:
    """x FP32[N, 4] reshaped to [-1, max(x)]: its shape depends on the data, so ONNX Runtime
    declares it [M, K] (the model looks batchable), yet it has 4N rows for a batch of N. Cut
    to the request's rows it would be wrong: the run fails instead."""
    minus_one = helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])
    zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
    path = _model(
        folder / "flattened.onnx",
        [
            helper.make_node("Constant", [], ["minus_one"], value=minus_one),
            helper.make_node("Constant", [], ["zero"], value=zero),
            helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
            helper.make_node("Cast", ["top"], ["k"], to=TensorProto.INT64),
            helper.make_node("Unsqueeze", ["k", "zero"], ["k1"]),
            helper.make_node("Concat", ["minus_one", "k1"], ["shape"], axis=0),
            helper.make_node("Reshape", ["x", "shape"], ["y"]),
        ],
        [_fp32("x", ["N", 4])],
        [_fp32("y", ["M", "K"])],
    )
    for engine in staged(path):
        assert engine.padded
        x = np.ones((3, 4), np.float32)
        with pytest.raises(ModelFailed, match="'y' has 16 rows for a batch of 4"):
            await _run(engine, [{"x": x}])


def test_only_onnx_runtimes_input_checks_are_the_callers_fault() -> None:
    misfit = RuntimeError("Error in execution: Got invalid dimensions for input: x ...")
    assert isinstance(_run_error(misfit), InvalidInput)
    kernel = RuntimeError(
        "Error in execution: Non-zero status code returned while running Reshape node. "
        "Invalid input shape"
    )
    assert isinstance(_run_error(kernel), ModelFailed)


def test_split_copies_unless_told_to_cut_views() -> None:
    """ONNX Runtime's own output arrays stay alive as long as a view of them does: a batch's
    requests get views. Outputs in pooled buffers, which go back to the pool, are copied."""
    out = np.arange(12, dtype=np.float32).reshape(3, 4)
    viewed = staging.split({"y": out}, [1, 2], views={"y"})
    assert all(np.shares_memory(r["y"], out) for r in viewed)
    copied = staging.split({"y": out}, [1, 2])
    assert not any(np.shares_memory(r["y"], out) for r in copied)
    for result in (viewed, copied):
        np.testing.assert_array_equal(np.concatenate([r["y"] for r in result]), out)


async def test_a_batch_gets_views_of_onnx_runtimes_outputs_and_copies_of_pooled_ones(
    folder: Path,
) -> None:
    """`wide` has no known row shape, so ONNX Runtime allocates it: each request's rows are a
    view of that one array. `fixed` sits in a pooled buffer: each request gets a copy."""
    path = _model(
        folder / "two_outputs.onnx",
        [helper.make_node("Add", ["x", "x"], ["wide"]), helper.make_node("Neg", ["k"], ["fixed"])],
        [_fp32("x", ["N", "W"]), _fp32("k", ["N", 4])],
        [_fp32("wide", ["N", "W"]), _fp32("fixed", ["N", 4])],
    )
    for engine in staged(path):
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        k = np.arange(12, dtype=np.float32).reshape(3, 4)
        for _ in range(2):  # the second time from pooled buffers
            results = await _run(engine, [{"x": x[:1], "k": k[:1]}, {"x": x[1:], "k": k[1:]}])
            np.testing.assert_array_equal(np.concatenate([r["wide"] for r in results]), 2 * x)
            np.testing.assert_array_equal(np.concatenate([r["fixed"] for r in results]), -k)
            first, second = (r["wide"] for r in results)
            assert first.base is not None and first.base is second.base
            assert all(r["fixed"].flags.owndata for r in results)
