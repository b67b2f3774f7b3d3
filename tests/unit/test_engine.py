"""The engine against the bundled model, without a socket."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from sluice import models
from sluice.core.errors import InvalidInput
from sluice.server.dataplane.batcher import Pending
from sluice.server.dataplane.buffers import BufferPool
from sluice.server.dataplane.engine import Engine, Instance, choose_providers
from tests.conftest import SAMPLES


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(models.DIGITS, device="cpu")


def test_specs_describe_the_model(engine: Engine) -> None:
    assert engine.name == "digits"
    assert engine.provider == "CPUExecutionProvider"
    assert [(s.name, s.datatype, s.shape) for s in engine.inputs] == [("input", "FP32", (None, 64))]
    assert [s.describe() for s in engine.outputs] == ["INT64[N]", "FP32[N, 10]"]


def test_run_matches_onnxruntime(engine: Engine, reference: ort.InferenceSession) -> None:
    batch = np.concatenate([s.input for s in SAMPLES])
    assert engine.check({"input": batch}) == []
    got, pooled = engine.instances[0].run_sync({"input": batch}, engine.check_outputs([]), 10)
    assert pooled == []
    label, probabilities = reference.run(None, {"input": batch})
    np.testing.assert_array_equal(got["label"], label)
    np.testing.assert_array_equal(got["probabilities"], probabilities)
    assert engine.check_outputs(["probabilities", "probabilities"]) == ["probabilities"]


@pytest.mark.parametrize("stage_always", [False, True], ids=["direct", "staged"])
async def test_batches_through_onnxruntime_split_back_exactly(
    engine: Engine, reference: ort.InferenceSession, stage_always: bool
) -> None:
    """Requests of 1, 3 and 2 rows merged into one run and split back; `staged` is the path
    CUDA takes (inputs and outputs in pooled buffers), exercised here on the CPU."""
    instance = Instance(
        0,
        engine.instances[0].session,
        pool=BufferPool(),
        executor=engine.executor,
        output_specs=engine.outputs,
        stage_always=stage_always,
    )
    rows = np.concatenate([s.input for s in SAMPLES])
    parts = [rows[0:1], rows[1:4], rows[4:6]]
    outputs = ("label", "probabilities")
    batch = [Pending({"input": p}, outputs, len(p), "g", 0.0) for p in parts]
    for _ in range(2):  # the second time, the staging buffers come from the pool
        results = await instance.run(batch)
        for part, result in zip(parts, results, strict=True):
            label, probabilities = reference.run(None, {"input": part})
            np.testing.assert_array_equal(result["label"], label)
            np.testing.assert_array_equal(result["probabilities"], probabilities)
    assert instance.pool.stats().reused >= 1
    alone = await instance.run(batch[:1])
    np.testing.assert_array_equal(
        alone[0]["label"], reference.run(["label"], {"input": parts[0]})[0]
    )


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"input": np.zeros((1, 64), np.float32), "extra": np.zeros(1)}, "unknown input 'extra'"),
        ({}, "missing input 'input' FP32\\[N, 64\\]"),
        ({"input": np.zeros((1, 64), np.int64)}, "is INT64 but the model takes FP32"),
        ({"input": np.zeros((1, 1, 64), np.float32)}, "rank 3"),
        ({"input": np.zeros((2, 65), np.float32)}, "size 65 in dimension 1"),
        ({"input": np.zeros((0, 64), np.float32)}, "is empty"),
    ],
)
def test_check_rejects_inputs_that_do_not_fit(
    engine: Engine, inputs: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        engine.check(inputs)


def test_nonfinite_inputs_are_reported_not_rejected(engine: Engine) -> None:
    x = np.zeros((2, 64), np.float32)
    x[1, 5] = -np.inf
    assert engine.check({"input": x}) == ["input"]


def test_unknown_output(engine: Engine) -> None:
    with pytest.raises(InvalidInput, match="unknown output 'logits'"):
        engine.check_outputs(["logits"])


def test_cpu_device_never_asks_for_cuda() -> None:
    assert choose_providers("cpu") == ["CPUExecutionProvider"]


def test_auto_falls_back_to_cpu_without_a_gpu(engine: Engine) -> None:
    # This suite runs on CPU-only machines; with a GPU, auto must pick CUDA instead.
    auto = Engine(models.DIGITS, device="auto")
    has_gpu = "CUDAExecutionProvider" in choose_providers("auto")
    assert auto.provider == ("CUDAExecutionProvider" if has_gpu else "CPUExecutionProvider")


def test_missing_model_file() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine("no/such/model.onnx")
