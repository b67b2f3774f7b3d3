"""Compact wire types on a real sluice-server: an FP32 input that also takes UINT8 (and FP16,
INT8) on the wire, named in a repository model's config.pbtxt or by --accept for a --model,
answered through sluice.v1 Predict and KServe ModelInfer alike; what it does not take is
refused naming what it does, and a config naming an input the model lacks is refused."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice import models
from sluice.core.datatypes import DATATYPES
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import SAMPLES, scale_model
from tests.e2e.harness import Process, running, server_argv, wait_for

pytestmark = pytest.mark.e2e

WIDTH = 4
BY_255 = "0.00392156862745098"  # 1/255, as written in a config
DTYPES = {n: DATATYPES[n].dtype for n in ("UINT8", "INT8", "FP16", "FP32", "INT64")}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def config(accepts: dict[str, str]) -> str:
    return "".join(
        f'parameters {{ key: "sluice.accept.{name}" value: {{ string_value: "{spec}" }} }}\n'
        for name, spec in accepts.items()
    )


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("identity") / "identity.onnx"
    path.write_bytes(scale_model(1.0, WIDTH))  # y = x: the answer is what the model got
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, identity: Path) -> Iterator[Process]:
    """A repository: digits taking UINT8 and FP16 * 0.5; the identity taking UINT8 / 255 and
    INT8 / 255 - 0.5; one whose config names an input its model lacks."""
    root = tmp_path_factory.mktemp("repository")
    for name, model, accepts in (
        ("digits", models.DIGITS, {"input": "UINT8, FP16*0.5"}),
        ("identity", identity, {"x": f"UINT8*{BY_255}, INT8*{BY_255}-0.5"}),
        ("wrong", identity, {"image": "UINT8"}),
    ):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(model, root / name / "1" / "model.onnx")
        (root / name / "config.pbtxt").write_text(config(accepts))
    with running(server_argv("--model-repository", str(root)), start_s=60.0) as proc:
        yield proc


def predict(address: str, model: str, name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    tensor = pb.Tensor(name=name, datatype=NAMES[x.dtype], shape=x.shape, raw_data=x.tobytes())
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.InferenceStub(channel).Predict(
            pb.PredictRequest(model=model, inputs=[tensor]), timeout=10
        )
    return {
        t.name: np.frombuffer(t.raw_data, DTYPES[t.datatype]).reshape(t.shape)
        for t in reply.outputs
    }


def model_infer(address: str, model: str, name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    tensor = kpb.ModelInferRequest.InferInputTensor(
        name=name, datatype=NAMES[x.dtype], shape=x.shape
    )
    request = kpb.ModelInferRequest(
        model_name=model, inputs=[tensor], raw_input_contents=[x.tobytes()]
    )
    with grpc.insecure_channel(address) as channel:
        reply = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    return {
        t.name: np.frombuffer(raw, DTYPES[t.datatype]).reshape(t.shape)
        for t, raw in zip(reply.outputs, reply.raw_output_contents, strict=True)
    }


CALLS = {"predict": predict, "modelinfer": model_infer}


def digits() -> np.ndarray:
    x = np.concatenate([s.input for s in SAMPLES])
    assert (x == np.round(x)).all() and x.max() <= 16  # the pixels are whole numbers
    return x


@pytest.mark.parametrize("call", list(CALLS))
def test_uint8_pixels_answer_as_the_same_values_sent_as_fp32(server: Process, call: str) -> None:
    x = digits()
    send = CALLS[call]
    expected = send(server.address, "digits", "input", x)
    got = send(server.address, "digits", "input", x.astype(np.uint8))
    assert list(got) == list(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(got[name], array)
    half = send(server.address, "digits", "input", (x * 2).astype(np.float16))
    for name, array in expected.items():  # FP16 * 0.5: the values again
        np.testing.assert_array_equal(half[name], array)


@pytest.mark.parametrize("call", list(CALLS))
def test_scale_and_offset_are_applied_by_the_server(server: Process, call: str) -> None:
    send = CALLS[call]
    pixels = np.arange(256, dtype=np.uint8).reshape(-1, WIDTH)
    got = send(server.address, "identity", "x", pixels)["y"]
    np.testing.assert_allclose(got, (pixels / 255).astype(np.float32), rtol=1e-6)
    signed = np.array([[-128, -1, 0, 127]], np.int8)
    got = send(server.address, "identity", "x", signed)["y"]
    expected = signed.astype(np.float32) * np.float32(1 / 255) + np.float32(-0.5)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("call", list(CALLS))
def test_a_type_the_input_does_not_take_is_refused_naming_what_it_takes(
    server: Process, call: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        CALLS[call](server.address, "digits", "input", digits().astype(np.int8))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "input 'input' is INT8 but the model takes FP32 (or, cast by the server, UINT8, FP16*0.5)"
        in str(caught.value.details())
    )


def test_a_config_naming_an_input_the_model_lacks_is_refused_at_load(server: Process) -> None:
    line = wait_for(
        lambda: next((ln for ln in server.lines if "model wrong version 1 refused" in ln), None),
        "the refusal of model 'wrong'",
    )
    assert "wire types are given for input 'image', which the model does not have" in line


def test_the_flag_gives_a_model_its_wire_types(identity: Path) -> None:
    argv = server_argv(
        *("--model", f"ident={identity}"),
        *("--model", f"digits={models.DIGITS}"),
        *("--accept", f"ident:x=UINT8*{BY_255}"),
        *("--accept", "digits:input=UINT8"),
    )
    with running(argv, start_s=60.0) as proc:
        pixels = np.arange(256, dtype=np.uint8).reshape(-1, WIDTH)
        got = predict(proc.address, "ident", "x", pixels)["y"]
        np.testing.assert_allclose(got, (pixels / 255).astype(np.float32), rtol=1e-6)
        x = digits()
        assert predict(proc.address, "digits", "input", x.astype(np.uint8))["label"].tolist() == (
            predict(proc.address, "digits", "input", x)["label"].tolist()
        )


def test_a_flag_naming_no_model_stops_the_start(identity: Path) -> None:
    argv = server_argv(
        *("--model", f"ident={identity}"),
        *("--model", f"digits={models.DIGITS}"),
        *("--accept", "x=UINT8"),
    )
    with (
        pytest.raises(RuntimeError, match="names none of the 2 --model entries"),
        running(argv, start_s=60.0),
    ):
        pass
