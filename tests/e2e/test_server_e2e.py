"""A real sluice-server process on 127.0.0.1: predictions, grpcurl, hostile inputs."""

from __future__ import annotations

import json
import subprocess

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.models import Sample
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, Process, grpcurl

pytestmark = pytest.mark.e2e


def expected(reference: ort.InferenceSession, x: np.ndarray) -> dict[str, np.ndarray]:
    label, probabilities = reference.run(None, {"input": x})
    return {"label": label, "probabilities": probabilities}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: f"digit-{s.label}")
def test_sync_client_matches_onnxruntime(
    server: Process, reference: ort.InferenceSession, sample: Sample
) -> None:
    with SluiceClient(server.address) as client:
        answer = client.infer({"input": sample.input}, request_id=f"req-{sample.label}")
    assert_same(answer.outputs, expected(reference, sample.input))
    assert answer.node_id == "test-node"
    assert answer.request_id == f"req-{sample.label}"


async def test_async_client_matches_onnxruntime(
    server: Process, reference: ort.InferenceSession
) -> None:
    batch = np.concatenate([s.input for s in SAMPLES])
    async with AsyncSluiceClient(server.address) as client:
        for sample in SAMPLES:
            got = await client.predict({"input": sample.input})
            assert_same(got, expected(reference, sample.input))
        # A batch of rows in one call, and an output subset.
        got = await client.predict({"input": batch}, outputs=["label"])
    assert list(got) == ["label"]
    np.testing.assert_array_equal(got["label"], expected(reference, batch)["label"])


def test_cli_predict_matches_onnxruntime(server: Process, reference: ort.InferenceSession) -> None:
    sample = SAMPLES[2]  # one is enough: every sample takes this path, and the sync client test
    # compares every sample's answer with ONNX Runtime
    want = expected(reference, sample.input)
    for value in (str(sample.path), json.dumps(sample.input.tolist())):
        out = subprocess.run(
            [
                str(BIN / "sluice"),
                "predict",
                "--target",
                server.address,
                "--json-output",
                f"input={value}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        got = json.loads(out.stdout)["outputs"]
        assert got["label"]["data"] == want["label"].tolist()
        assert got["probabilities"]["data"] == want["probabilities"].tolist()


def test_cli_reports_errors_readably(server: Process) -> None:
    out = subprocess.run(
        [str(BIN / "sluice"), "predict", "--target", server.address, "input=[[1, 2]]"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "needs 64" in out.stderr
    assert "Traceback" not in out.stderr


def test_grpcurl_list_describe_predict_health(
    server: Process, reference: ort.InferenceSession
) -> None:
    services = grpcurl(server.address, "list").split()
    assert {"sluice.v1.Inference", "grpc.health.v1.Health"} <= set(services)
    described = grpcurl(server.address, "describe", "sluice.v1.Inference")
    for method in ("Predict", "Health", "Metadata"):
        assert f"rpc {method}" in described

    sample = SAMPLES[3]
    body = {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 64],
                "fp32_data": sample.input[0].tolist(),
            }
        ],
        "typed_outputs": True,
    }
    reply = json.loads(
        grpcurl("-d", json.dumps(body), server.address, "sluice.v1.Inference/Predict")
    )
    outputs = {t["name"]: t for t in reply["outputs"]}
    want = expected(reference, sample.input)
    assert [int(v) for v in outputs["label"]["int64_data"]] == want["label"].tolist()
    np.testing.assert_allclose(outputs["probabilities"]["fp32_data"], want["probabilities"][0])

    check = json.loads(grpcurl(server.address, "grpc.health.v1.Health/Check"))
    assert check == {"status": "SERVING"}


def tensor(name: str = "input", datatype: str = "FP32", shape=(1, 64), **fields) -> pb.Tensor:
    if not fields:
        count = int(np.prod(shape))
        fields = {"raw_data": np.ones(count, np.float32).tobytes()}
    return pb.Tensor(name=name, datatype=datatype, shape=shape, **fields)


# Bodies the server must refuse with INVALID_ARGUMENT and a message naming the fault, and go
# on serving. The unit tests hold each of the model's checks and the codec's; here is
# one case of each (through the real server, and through the balancer in its own tests).
HOSTILE = {
    # The model's checks (unit: tests/unit/test_dataplane.py).
    "wrong dimension": ([tensor(shape=(1, 63))], "needs 64"),
    # The codec's checks (unit: tests/unit/test_codec.py).
    "byte length off by one": (
        [tensor(raw_data=b"\0" * 255)],
        "255 bytes of raw_data but FP32 shape [1, 64] needs 256",
    ),
}


def predict_raw(address: str, body: bytes) -> bytes:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/sluice.v1.Inference/Predict")
        reply: bytes = call(body, timeout=10)
        return reply


def assert_still_correct(server: Process, reference: ort.InferenceSession) -> None:
    with SluiceClient(server.address) as client:
        got = client.predict({"input": SAMPLES[0].input})
    assert_same(got, expected(reference, SAMPLES[0].input))


@pytest.mark.parametrize("case", list(HOSTILE), ids=lambda c: c.replace(" ", "-"))
def test_hostile_input_is_invalid_argument(
    server: Process, reference: ort.InferenceSession, case: str
) -> None:
    inputs, message = HOSTILE[case]
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Predict(pb.PredictRequest(inputs=inputs), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    assert_still_correct(server, reference)


def test_random_bytes_are_invalid_argument(
    server: Process, reference: ort.InferenceSession
) -> None:
    body = np.random.default_rng(7).bytes(512)
    with pytest.raises(grpc.RpcError) as caught:
        predict_raw(server.address, body)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid sluice.v1.PredictRequest" in caught.value.details()
    assert_still_correct(server, reference)


def test_nan_and_infinity_are_allowed_and_flagged(
    server: Process, reference: ort.InferenceSession
) -> None:
    x = SAMPLES[1].input.copy()
    x[0, 3], x[0, 9] = np.nan, np.inf
    with SluiceClient(server.address) as client:
        answer = client.infer({"input": x})
    assert answer.metadata["x-nonfinite-inputs"] == "input"
    want = expected(reference, x)
    np.testing.assert_array_equal(answer.outputs["probabilities"], want["probabilities"])
    assert_still_correct(server, reference)


def test_message_over_the_limit_is_resource_exhausted(
    server: Process, reference: ort.InferenceSession
) -> None:
    # The fixture's server takes at most 1 MiB; this request is 2 MiB.
    big = np.zeros((8192, 64), np.float32)
    with SluiceClient(server.address) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict({"input": big})
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_still_correct(server, reference)


def test_health_and_metadata(server: Process) -> None:
    with SluiceClient(server.address) as client:
        client.predict({"input": SAMPLES[0].input})
        health = client.health()
        meta = client.metadata()
    assert health.node_id == "test-node"
    assert health.status == "SERVING"
    assert health.provider == "CPUExecutionProvider"
    assert health.requests >= 1 and health.latency.count >= 1
    assert health.latency.p50_ms > 0 and health.latency.max_ms >= health.latency.p99_ms
    assert health.uptime_s > 0
    assert health.model.name == "digits"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.model.inputs] == [
        ("input", "FP32", [-1, 64])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.model.outputs] == [
        ("label", "INT64", [-1]),
        ("probabilities", "FP32", [-1, 10]),
    ]
    assert meta.platform.startswith("onnxruntime ")


def test_errors_are_counted_by_code(server: Process) -> None:
    with SluiceClient(server.address) as client:
        before = client.health().errors_by_code["INVALID_ARGUMENT"]
        with pytest.raises(grpc.RpcError):
            client.predict({"input": np.zeros((1, 3), np.float32)})
        after = client.health().errors_by_code["INVALID_ARGUMENT"]
    assert after == before + 1
