"""The benchmark models that take a 602 KB image (FP32 [N, 3, 224, 224]): the SqueezeNet 1.1
(perf/make_squeezenet.py) and the model that only averages its input (perf/make_pool.py).
Their topology and numerics, run in CPU onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from perf import make_pool, make_squeezenet

IMAGE = 224


def session(data: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def squeezenet() -> bytes:
    return make_squeezenet.build(seed=0)


def params(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(init.dims)) for init in model.graph.initializer)


def test_squeezenet_topology_and_size(squeezenet: bytes) -> None:
    model = onnx.load_from_string(squeezenet)
    assert model.opset_import[0].version == 17
    # conv1, three per Fire module (squeeze, 1x1 and 3x3 expand) times eight, conv10
    assert sum(node.op_type == "Conv" for node in model.graph.node) == 26
    assert sum(node.op_type == "Concat" for node in model.graph.node) == 8
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    assert shapes["conv1.weight"] == [32, 3, 3, 3]  # half of SqueezeNet 1.1's channels
    assert shapes["fire9.expand3x3.weight"] == [128, 32, 3, 3]
    assert shapes["conv10.weight"] == [1000, 256, 1, 1]  # all 1000 classes kept
    assert params(onnx.load_from_string(make_squeezenet.build(width=1))) == 1_235_496  # 1.1's
    (inp,) = model.graph.input
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert inp.name == "input" and dims == ["N", 3, IMAGE, IMAGE]
    (out,) = model.graph.output
    dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
    assert out.name == "output" and dims == ["N", 1000]


def test_squeezenet_runs_finite_batch_independent_and_seeded(squeezenet: bytes) -> None:
    run = session(squeezenet)
    x = np.random.default_rng(7).random((2, 3, IMAGE, IMAGE), dtype=np.float32)
    assert x[:1].nbytes == 602_112
    (one,) = run.run(["output"], {"input": x[:1]})
    (two,) = run.run(["output"], {"input": x})
    assert one.shape == (1, 1000) and two.shape == (2, 1000) and one.dtype == np.float32
    assert np.isfinite(one).all() and np.isfinite(two).all()
    np.testing.assert_allclose(two[0], one[0], rtol=1e-4, atol=1e-5)
    assert not np.allclose(two[0], two[1], rtol=1e-4, atol=1e-5)
    assert np.count_nonzero(one) > 100 and np.ptp(one) > 0  # He init keeps the signal alive
    # the same seed makes the same model, another seed another one
    assert make_squeezenet.build(seed=0) == squeezenet
    (other,) = session(make_squeezenet.build(seed=1)).run(["output"], {"input": x[:1]})
    assert not np.allclose(other, one)


def test_averaging_model_is_the_inputs_channel_means() -> None:
    run = session(make_pool.build(IMAGE))
    x = np.random.default_rng(3).random((2, 3, IMAGE, IMAGE), dtype=np.float32)
    (out,) = run.run(["output"], {"input": x})
    assert out.shape == (2, 3) and out.dtype == np.float32
    np.testing.assert_allclose(out, x.mean(axis=(2, 3)), rtol=1e-5)
