"""The engine against the bundled model, without a socket."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from sluice import models
from sluice.core.errors import Unavailable
from sluice.server.dataplane import gpu
from sluice.server.dataplane.batcher import Batcher, Pending
from sluice.server.dataplane.buffers import BufferPool
from sluice.server.dataplane.engine import (
    MAX_AUTO_THREADS,
    SHRINK_FROM,
    Engine,
    Instance,
    choose_providers,
    zeros,
)
from sluice.server.dataplane.models import Model, Models
from sluice.server.v1 import model_statuses
from tests.conftest import SAMPLES

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"


def test_specs_describe_the_model(engine: Engine) -> None:
    assert engine.name == "digits"
    assert engine.provider == CPU
    assert [(s.name, s.datatype, s.shape) for s in engine.inputs] == [("input", "FP32", (None, 64))]
    assert [s.describe() for s in engine.outputs] == ["INT64[N]", "FP32[N, 10]"]


def test_run_matches_onnxruntime(engine: Engine, reference: ort.InferenceSession) -> None:
    batch = np.concatenate([s.input for s in SAMPLES])
    got, pooled = engine.instances[0].run_sync({"input": batch}, ["label", "probabilities"], 10)
    assert pooled == []
    label, probabilities = reference.run(None, {"input": batch})
    np.testing.assert_array_equal(got["label"], label)
    np.testing.assert_array_equal(got["probabilities"], probabilities)


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


def test_cpu_device_never_asks_for_cuda(engine: Engine) -> None:
    # The fixture asked for the CPU: its sessions hold the CPU provider alone, even with a
    # CUDA build of ONNX Runtime installed.
    assert choose_providers("cpu") == [CPU]
    assert [i.session.get_providers() for i in engine.instances] == [[CPU]]


def test_auto_falls_back_to_cpu_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "device_count", lambda: 0)  # no GPU, here or not
    auto = Engine(models.DIGITS, device="auto")
    try:
        assert auto.provider == CPU
        assert auto.instances[0].session.get_providers() == [CPU]
    finally:
        auto.close()


@pytest.mark.parametrize(
    ("device", "built", "gpus", "want"),
    [
        ("cpu", [CUDA, CPU], 1, [CPU]),
        ("auto", [CPU], 0, [CPU]),
        ("auto", [CPU], 1, [CPU]),
        ("auto", [CUDA, CPU], 0, [CPU]),
        ("auto", [CUDA, CPU], 1, [CUDA, CPU]),
        ("cuda", [CUDA, CPU], 1, [CUDA, CPU]),  # asked for: the session says if it starts
    ],
)
def test_choose_providers(
    monkeypatch: pytest.MonkeyPatch, device: str, built: list[str], gpus: int, want: list[str]
) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: built)
    monkeypatch.setattr(gpu, "device_count", lambda: gpus)
    assert choose_providers(device) == want


def test_cuda_device_without_a_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CPU])
    with pytest.raises(Unavailable, match="no CUDA provider"):
        choose_providers("cuda")


def test_cuda_device_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(gpu, "device_count", lambda: 0)
    with pytest.raises(Unavailable, match="sees no GPU"):
        choose_providers("cuda")


needs_cuda_build = pytest.mark.skipif(
    CUDA not in ort.get_available_providers(), reason="a CPU build of onnxruntime is installed"
)


@pytest.mark.skipif(CUDA in ort.get_available_providers(), reason="a CUDA build is installed")
def test_auto_with_a_cpu_build_on_a_gpu_machine_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """sluice[cpu] where a GPU is: the model serves on the CPU, a WARNING names the build to
    install, and Health's `fallback` keeps the reason."""
    monkeypatch.setattr(gpu, "device_count", lambda: 1)
    with caplog.at_level("WARNING", logger="sluice.engine"):
        auto = Engine(models.DIGITS, device="auto")
    try:
        assert auto.provider == CPU
        assert auto.fallback == (
            "this onnxruntime build has no CUDA provider (pip install 'sluice[gpu]')"
        )
        assert any(auto.fallback in r.getMessage() for r in caplog.records)
        model = Model(auto, Batcher(auto.instances, max_rows=1, budget_s=0.0))
        (status,) = model_statuses(Models([model]))
        assert (status.provider, status.fallback) == (CPU, auto.fallback)
    finally:
        auto.close()
    monkeypatch.setattr(gpu, "device_count", lambda: 0)
    quiet = Engine(models.DIGITS, device="auto")  # no GPU: the CPU is no fallback
    try:
        assert quiet.fallback == ""
    finally:
        quiet.close()


@needs_cuda_build
def test_auto_that_gets_the_cpu_says_so_loudly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU is claimed where ONNX Runtime cannot start CUDA (this machine has no driver or
    CUDA libraries): the model serves on the CPU, a WARNING says why, `fallback` keeps the
    reason for Health, and no CuPy memory or stream is made for a CPU session."""
    if gpu.device_count():
        pytest.skip("a real GPU is here: CUDA may well start")
    monkeypatch.setattr(gpu, "device_count", lambda: 1)
    with caplog.at_level("WARNING", logger="sluice.engine"):
        auto = Engine(models.DIGITS, device="auto", instances=2)
    try:
        assert auto.provider == CPU
        assert auto.fallback.startswith("ONNX Runtime could not start its CUDA provider")
        for missing in gpu.missing_libraries():
            assert missing in auto.fallback
        assert any(auto.fallback in r.getMessage() for r in caplog.records)
        assert not auto.pinned and not auto.staged
        assert [i.stream for i in auto.instances] == [None, None]
        assert [i.session.get_providers() for i in auto.instances] == [[CPU], [CPU]]
        # Health and Metadata list it with each model.
        model = Model(auto, Batcher(auto.instances, max_rows=1, budget_s=0.0))
        (status,) = model_statuses(Models([model]))
        assert (status.provider, status.fallback) == (CPU, auto.fallback)
    finally:
        auto.close()


@needs_cuda_build
def test_cuda_device_that_cannot_start_refuses_to_load(monkeypatch: pytest.MonkeyPatch) -> None:
    if gpu.device_count():
        pytest.skip("a real GPU is here: CUDA may well start")
    monkeypatch.setattr(gpu, "device_count", lambda: 1)
    with pytest.raises(Unavailable, match="--device cuda, but ONNX Runtime could not start"):
        Engine(models.DIGITS, device="cuda")


def test_missing_model_file() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine("no/such/model.onnx")


def test_auto_threads_stay_one_for_a_tiny_model_and_are_measured_for_a_convnet() -> None:
    tiny = Engine(models.DIGITS, device="cpu", intra_op_threads=None)
    assert tiny.intra_op_threads == 1  # a 13 us run: more threads would only cost
    tiny.close()
    convnet = Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"
    heavy = Engine(convnet, device="cpu", intra_op_threads=None)
    # Chosen by measurement: more than one only where the machine has the cores for it.
    assert heavy.intra_op_threads in (1, min(os.cpu_count() or 1, MAX_AUTO_THREADS))
    heavy.close()


class Slow:
    """A session whose runs take 5 ms longer: what a busy machine does to a tiny model."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session

    def run(
        self,
        outputs: list[str],
        inputs: dict[str, np.ndarray],
        options: ort.RunOptions | None = None,
    ) -> list[np.ndarray]:
        time.sleep(0.005)
        return self.session.run(outputs, inputs, options)


def test_the_inline_decision_is_made_from_the_cost_measured_at_load() -> None:
    """Digits' run takes ~15 us: inline (on the event loop) from its first call, and still
    after runs made slow by load, which no longer move the decision."""
    engine = Engine(models.DIGITS, device="cpu", inline_max_s=100e-6)
    try:
        instance = engine.instances[0]
        x, outputs = SAMPLES[0].input, ["label", "probabilities"]
        first = instance.run_inline({"input": x}, outputs, 1)
        assert first is not None
        np.testing.assert_array_equal(first["label"], [SAMPLES[0].label])
        fast, instance.session = instance.session, Slow(instance.session)  # type: ignore[assignment]
        for _ in range(10):
            assert instance.run_inline({"input": x}, outputs, 1) is not None
        instance.session = fast
        # Its cost is per row: a batch of 10,000 rows runs in a thread.
        assert instance.run_inline({"input": np.repeat(x, 10_000, 0)}, outputs, 10_000) is None
    finally:
        engine.close()


def test_a_model_that_costs_more_than_the_bound_never_runs_inline() -> None:
    convnet = Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"
    for path, bound in ((convnet, 100e-6), (models.DIGITS, 0.0)):
        engine = Engine(path, device="cpu", inline_max_s=bound)
        try:
            inputs = zeros(engine.inputs)
            assert engine.instances[0].run_inline(inputs, [engine.outputs[0].name], 1) is None
        finally:
            engine.close()


def test_the_cpu_arena_is_off_unless_asked_for_and_a_large_run_gives_it_back() -> None:
    """--ort-arena: the session's arena is on; a run whose inputs pass SHRINK_FROM asks
    ONNX Runtime to give the arena's unused chunks back (a run option ORT refuses on a
    session without an arena, so the shrink is only ever asked of one that has it)."""
    off = Engine(models.DIGITS, device="cpu")
    on = Engine(models.DIGITS, device="cpu", arena=True)
    try:
        assert not off.arena and not off.instances[0].shrink
        assert on.arena and on.instances[0].shrink
        rows = SHRINK_FROM // (64 * 4) + 1
        big = {"input": np.zeros((rows, 64), np.float32)}
        for engine in (off, on):
            results, _ = engine.instances[0].run_sync(big, ["label"], rows)
            assert results["label"].shape == (rows,)
    finally:
        off.close()
        on.close()
