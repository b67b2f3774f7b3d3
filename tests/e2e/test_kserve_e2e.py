"""The KServe v2 API (inference.GRPCInferenceService) of a real sluice-server: ModelInfer
through the generated stub, grpcurl and a PredictStream message, answers equal to ONNX Runtime,
status codes, the cache and the id echo."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from sluice.v1 import inference_pb2 as pb
from tests.conftest import SAMPLES, scale_model
from tests.e2e.harness import Process, grpcurl, running, server_argv

pytestmark = pytest.mark.e2e

SERVICE = "inference.GRPCInferenceService"
InputTensor = kpb.ModelInferRequest.InferInputTensor


def raw_request(x: np.ndarray, model_name: str = "digits", **kw: Any) -> kpb.ModelInferRequest:
    return kpb.ModelInferRequest(
        model_name=model_name,
        inputs=[InputTensor(name="input", datatype="FP32", shape=x.shape)],
        raw_input_contents=[x.tobytes()],
        **kw,
    )


def typed_request(x: np.ndarray, model_name: str = "digits", **kw: Any) -> kpb.ModelInferRequest:
    contents = kpb.InferTensorContents(fp32_contents=x.reshape(-1).tolist())
    return kpb.ModelInferRequest(
        model_name=model_name,
        inputs=[InputTensor(name="input", datatype="FP32", shape=x.shape, contents=contents)],
        **kw,
    )


def outputs_of(response: kpb.ModelInferResponse) -> dict[str, np.ndarray]:
    dtypes = {"INT64": np.int64, "FP32": np.float32}
    return {
        t.name: np.frombuffer(raw, dtypes[t.datatype]).reshape(t.shape)
        for t, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


def assert_matches(
    response: kpb.ModelInferResponse, reference: ort.InferenceSession, x: np.ndarray
) -> None:
    label, probabilities = reference.run(None, {"input": x})
    got = outputs_of(response)
    assert list(got) == ["label", "probabilities"]
    np.testing.assert_array_equal(got["label"], label)
    np.testing.assert_array_equal(got["probabilities"], probabilities)


def infer(
    address: str, request: kpb.ModelInferRequest, metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[kpb.ModelInferResponse, dict[str, str]]:
    with grpc.insecure_channel(address) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        response, call = stub.ModelInfer.with_call(request, timeout=10, metadata=metadata)
    return response, dict(call.trailing_metadata())


def test_model_infer_raw_and_typed_match_onnxruntime(
    server: Process, reference: ort.InferenceSession
) -> None:
    x = np.concatenate([s.input for s in SAMPLES])
    for request in (raw_request(x, id="raw-1"), typed_request(x, id="typed-1")):
        response, trailers = infer(server.address, request, (("x-request-id", "r-1"),))
        assert (response.model_name, response.model_version) == ("digits", "1")
        assert response.id == request.id
        assert [(t.name, t.datatype, list(t.shape)) for t in response.outputs] == [
            ("label", "INT64", [10]),
            ("probabilities", "FP32", [10, 10]),
        ]
        assert_matches(response, reference, x)
        assert trailers["x-node-id"] == "test-node" and trailers["x-request-id"] == "r-1"


def test_a_repeat_is_a_cache_hit_with_its_own_id(
    server: Process, reference: ort.InferenceSession
) -> None:
    x = SAMPLES[6].input * 0.5  # an input no other test sends
    first, trailers = infer(server.address, raw_request(x, id="a"))
    assert trailers["x-cache"] == "miss" and first.id == "a"
    second, trailers = infer(server.address, raw_request(x, id="b"))
    assert trailers["x-cache"] == "hit" and second.id == "b"
    assert_matches(second, reference, x)
    _, trailers = infer(server.address, raw_request(x), (("x-cache-control", "no-cache"),))
    assert "x-cache" not in trailers


def test_an_output_subset(server: Process) -> None:
    asked = [kpb.ModelInferRequest.InferRequestedOutputTensor(name="probabilities")]
    response, _ = infer(server.address, raw_request(SAMPLES[1].input, outputs=asked))
    assert [t.name for t in response.outputs] == ["probabilities"]


BAD: dict[str, tuple[bytes, grpc.StatusCode, str]] = {
    "unknown model": (
        raw_request(SAMPLES[0].input, model_name="nope").SerializeToString(),
        grpc.StatusCode.NOT_FOUND,
        "unknown model 'nope'; this node serves 'digits'",
    ),
    "wrong shape": (
        raw_request(np.zeros((1, 63), np.float32)).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "size 63 in dimension 1",
    ),
    "byte length": (
        kpb.ModelInferRequest(
            inputs=[InputTensor(name="input", datatype="FP32", shape=[1, 64])],
            raw_input_contents=[b"\0" * 255],
        ).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "255 bytes in raw_input_contents but FP32 shape [1, 64] needs 256",
    ),
    "bytes datatype": (
        kpb.ModelInferRequest(
            inputs=[
                InputTensor(
                    name="input",
                    datatype="BYTES",
                    shape=[1],
                    contents=kpb.InferTensorContents(bytes_contents=[b"x"]),
                )
            ]
        ).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "is BYTES, which Sluice does not serve",
    ),
    "bad body": (
        np.random.default_rng(3).bytes(512),
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a valid inference.ModelInferRequest",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=lambda c: c.replace(" ", "-"))
def test_bad_requests_get_their_status(
    server: Process, reference: ort.InferenceSession, case: str
) -> None:
    body, code, message = BAD[case]
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        with pytest.raises(grpc.RpcError) as caught:
            call(body, timeout=10)
    assert caught.value.code() == code
    assert message in caught.value.details()
    response, _ = infer(server.address, raw_request(SAMPLES[0].input))  # still serving
    assert_matches(response, reference, SAMPLES[0].input)


def test_health_metadata_and_the_repository_api_off(server: Process) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(kpb.ServerLiveRequest(), timeout=10).live
        assert stub.ServerReady(kpb.ServerReadyRequest(), timeout=10).ready
        assert stub.ModelReady(kpb.ModelReadyRequest(name="digits"), timeout=10).ready
        assert not stub.ModelReady(kpb.ModelReadyRequest(name="nope"), timeout=10).ready
        meta = stub.ServerMetadata(kpb.ServerMetadataRequest(), timeout=10)
        assert meta.name == "sluice" and meta.version and not meta.extensions
        model = stub.ModelMetadata(kpb.ModelMetadataRequest(name="digits"), timeout=10)
        assert (model.name, list(model.versions), model.platform) == (
            "digits",
            ["1"],
            "onnxruntime_onnx",
        )
        assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [
            ("label", "INT64", [-1]),
            ("probabilities", "FP32", [-1, 10]),
        ]
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelMetadata(kpb.ModelMetadataRequest(name="nope"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        for call, request in (
            (stub.RepositoryIndex, kpb.RepositoryIndexRequest()),
            (stub.RepositoryModelLoad, kpb.RepositoryModelLoadRequest(model_name="digits")),
            (stub.RepositoryModelUnload, kpb.RepositoryModelUnloadRequest(model_name="digits")),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                call(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "--model-repository DIR --repository-api" in caught.value.details()


def test_model_infer_on_a_predict_stream(server: Process, reference: ort.InferenceSession) -> None:
    """How a balancer forwards ModelInfer: the body on its multiplexed PredictStream."""
    x = SAMPLES[8].input
    messages = [
        pb.StreamRequest(
            id=1,
            request=raw_request(x, id="s-1").SerializeToString(),
            method="ModelInfer",
            timeout_s=10,
            metadata={"x-request-id": "stream-1"},
        ),
        pb.StreamRequest(
            id=2,
            request=raw_request(np.zeros((1, 3), np.float32)).SerializeToString(),
            method="ModelInfer",
            timeout_s=10,
        ),
    ]
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream("/sluice.v1.Inference/PredictStream")
        raw = iter([m.SerializeToString() for m in messages])
        replies = {
            r.id: r for r in (pb.StreamResponse.FromString(b) for b in call(raw, timeout=10))
        }
    assert replies[1].code == 0, replies[1].message
    assert replies[1].trailers["x-request-id"] == "stream-1"
    response = kpb.ModelInferResponse.FromString(replies[1].response)
    assert response.id == "s-1"
    assert_matches(response, reference, x)
    assert replies[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "size 3 in dimension 1" in replies[2].message


def test_grpcurl_list_describe_and_model_infer(
    server: Process, reference: ort.InferenceSession
) -> None:
    assert SERVICE in grpcurl(server.address, "list").split()
    described = grpcurl(server.address, "describe", SERVICE)
    for method in ("ServerLive", "ModelMetadata", "ModelInfer", "RepositoryIndex"):
        assert f"rpc {method}" in described
    check = {"service": SERVICE}
    health = json.loads(
        grpcurl("-d", json.dumps(check), server.address, "grpc.health.v1.Health/Check")
    )
    assert health == {"status": "SERVING"}

    x = SAMPLES[5].input
    body = {
        "model_name": "digits",
        "id": "curl-1",
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 64],
                "contents": {"fp32_contents": x[0].tolist()},
            }
        ],
    }
    reply = json.loads(grpcurl("-d", json.dumps(body), server.address, f"{SERVICE}/ModelInfer"))
    assert reply["id"] == "curl-1" and reply["model_name"] == "digits"
    response = kpb.ModelInferResponse(
        outputs=[
            kpb.ModelInferResponse.InferOutputTensor(
                name=t["name"], datatype=t["datatype"], shape=[int(d) for d in t["shape"]]
            )
            for t in reply["outputs"]
        ],
        raw_output_contents=[base64.b64decode(r) for r in reply["raw_output_contents"]],
    )
    assert_matches(response, reference, x)


def test_the_repository_api_loads_and_unloads_behind_its_flag(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    (repository / "scale" / "1").mkdir(parents=True)
    (repository / "scale" / "1" / "model.onnx").write_bytes(scale_model(2.0))
    api = ("--model-repository", str(repository), "--repository-api")
    with running(server_argv(*api)) as proc, grpc.insecure_channel(proc.address) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        index = stub.RepositoryIndex(kpb.RepositoryIndexRequest())
        assert [(m.name, m.version, m.state) for m in index.models] == [("scale", "1", "READY")]
        meta = stub.ServerMetadata(kpb.ServerMetadataRequest())
        assert "model_repository" in meta.extensions
        stub.RepositoryModelUnload(kpb.RepositoryModelUnloadRequest(model_name="scale"))
        assert not stub.ModelReady(kpb.ModelReadyRequest(name="scale")).ready
        with pytest.raises(grpc.RpcError) as gone:
            stub.ModelInfer(scale_request(np.ones((1, 4), np.float32)))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        stub.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="scale"))
        assert stub.ModelReady(kpb.ModelReadyRequest(name="scale", version="1")).ready
        answer = stub.ModelInfer(scale_request(np.ones((1, 4), np.float32)))
        assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [2.0] * 4
        with pytest.raises(grpc.RpcError) as missing:
            stub.RepositoryModelLoad(kpb.RepositoryModelLoadRequest(model_name="nothing"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def scale_request(x: np.ndarray) -> kpb.ModelInferRequest:
    return kpb.ModelInferRequest(
        model_name="scale",
        inputs=[InputTensor(name="x", datatype="FP32", shape=x.shape)],
        raw_input_contents=[x.tobytes()],
    )
