"""The benchmark ResNet-50 (perf/make_resnet.py): its topology, size and numerics, built at
64x64 so CPU onnxruntime runs it in well under a second."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from perf.make_resnet import build

IMAGE = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / f"resnet50_{IMAGE}.onnx"
    path.write_bytes(build(image=IMAGE))
    return path


def test_topology_and_size(model_path: Path) -> None:
    model = onnx.load(str(model_path))
    assert sum(node.op_type == "Conv" for node in model.graph.node) == 53
    params = sum(int(np.prod(init.dims)) for init in model.graph.initializer)
    assert 25e6 < params < 26e6
    (inp,) = model.graph.input
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert inp.name == "input" and dims == ["N", 3, IMAGE, IMAGE]
    (out,) = model.graph.output
    dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
    assert out.name == "output" and dims == ["N", 1000]


def test_outputs_are_finite_batch_independent_and_input_dependent(model_path: Path) -> None:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    x = rng.random((3, 3, IMAGE, IMAGE), dtype=np.float32)
    (one,) = session.run(["output"], {"input": x[:1]})
    (three,) = session.run(["output"], {"input": x})
    assert one.shape == (1, 1000) and three.shape == (3, 1000)
    assert one.dtype == np.float32
    assert np.isfinite(one).all() and np.isfinite(three).all()
    np.testing.assert_allclose(three[0], one[0], rtol=1e-4, atol=1e-4)
    assert not np.allclose(three[0], three[1], rtol=1e-4, atol=1e-4)
    assert np.ptp(three[0]) > 0  # not all equal: the logits tell classes apart
