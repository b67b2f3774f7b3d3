"""What both tiers share: the bundled samples and ONNX Runtime called directly, the truth
the server must match. No process harness here: the unit tier starts nothing."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import settings

from sluice import models

# The same examples on every run: a property test that fails does so on every machine, not
# once in a while (a Maglev ring over 9 nodes with salt 669 moves 1.66x the ideal share of
# keys on a leave, past test_routing's 1.6x bound: found at random by one run in many).
settings.register_profile("sluice", derandomize=True, database=None)
settings.load_profile("sluice")

SAMPLES = models.samples()


@pytest.fixture(scope="session")
def reference() -> ort.InferenceSession:
    return ort.InferenceSession(str(models.DIGITS), providers=["CPUExecutionProvider"])


def scale_model(factor: float, width: int = 4) -> bytes:
    """A tiny ONNX model, y = x * factor over FP32[N, width]: versions built with different
    factors tell by their answers which one ran."""
    from onnx import TensorProto, helper, numpy_helper

    k = numpy_helper.from_array(np.full((1, width), factor, np.float32), "k")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        [k],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())
