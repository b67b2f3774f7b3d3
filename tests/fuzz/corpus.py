"""Seed bodies made from real messages: the digits model's samples as Predict bodies (raw and
typed), several inputs of each datatype, and ModelInfer bodies with an id, parameters and
raw_input_contents."""

from __future__ import annotations

import numpy as np

from sluice import models
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [
        rng.random((2, 3), np.float32),
        rng.integers(-5, 5, (3,), np.int64),
        np.array([[True, False]]),
        rng.random((1, 2)).astype(np.float16),
        rng.integers(0, 255, (2, 2), np.uint8),
        rng.random((1,), np.float64),
        np.zeros((0, 4), np.int8),
        np.array(7, np.int32),  # a scalar: shape []
    ]


def predict() -> list[bytes]:
    """sluice.v1 PredictRequest bodies."""
    digits = [s.input for s in models.samples()[:3]]
    bodies = []
    for typed in (False, True):
        for x in digits:
            bodies.append(
                pb.PredictRequest(
                    inputs=[codec.encode("input", x, typed=typed)],
                    outputs=["label"],
                    typed_outputs=typed,
                    model="digits",
                    version="1",
                ).SerializeToString()
            )
        arrays = {f"in{i}": a for i, a in enumerate(_arrays())}
        bodies.append(
            pb.PredictRequest(
                inputs=codec.encode_all(arrays, typed=typed), outputs=["a", "b"]
            ).SerializeToString()
        )
    two = [codec.encode("x", digits[0]), codec.encode("y", digits[1])]
    bodies.append(pb.PredictRequest(inputs=two, model="m").SerializeToString())
    bodies.append(pb.PredictRequest().SerializeToString())
    return bodies


def model_infer() -> list[bytes]:
    """KServe v2 ModelInferRequest bodies."""
    x = models.samples()[0].input
    tensor = kpb.ModelInferRequest.InferInputTensor
    raw = kpb.ModelInferRequest(
        model_name="digits",
        model_version="1",
        id="call-7",
        parameters={"priority": kpb.InferParameter(int64_param=2)},
        inputs=[tensor(name="input", datatype="FP32", shape=x.shape)],
        outputs=[kpb.ModelInferRequest.InferRequestedOutputTensor(name="label")],
        raw_input_contents=[x.tobytes()],
    )
    typed = kpb.ModelInferRequest(
        model_name="digits",
        id="é",
        inputs=[
            tensor(
                name="input",
                datatype="FP32",
                shape=x.shape,
                contents=kpb.InferTensorContents(fp32_contents=x.reshape(-1).tolist()),
                parameters={"binary": kpb.InferParameter(bool_param=True)},
            )
        ],
    )
    return [raw.SerializeToString(), typed.SerializeToString(), b""]


def metadata() -> list[bytes]:
    """sluice.v1 MetadataRequest bodies."""
    return [pb.MetadataRequest(model="digits", version="2").SerializeToString()]
