"""Two real servers with different models behind a real balancer: each call lands on a
server that serves its model, a model both serve spreads by affinity, an unknown model is
NOT_FOUND, and KServe v2 (ModelInfer, the model and server calls) goes through the
balancer too. What the balancer learns: a server back with other models, and a model
unloaded on one server (its calls go on to the other without a failure)."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf.message import Message

from sluice import models
from sluice.client import SluiceClient
from sluice.core.datatypes import DATATYPES
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, Process, running, server_argv, wait_health

pytestmark = pytest.mark.e2e

KSERVE = "/inference.GRPCInferenceService"
M = TypeVar("M", bound=Message)
SERVES = {"server-a": {"digits", "alpha"}, "server-b": {"digits", "beta"}}


@dataclass
class Fleet:
    a: Process
    b: Process
    balancer: Process


def model_argv(node_id: str, *names: str) -> list[str]:
    argv = server_argv("--default-model", "digits", node_id=node_id)
    for name in names:
        argv += ["--model", f"{name}={models.DIGITS}"]
    return argv


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with ExitStack() as stack:
        a = stack.enter_context(running(model_argv("server-a", "digits", "alpha")))
        b = stack.enter_context(running(model_argv("server-b", "digits", "beta")))
        argv = [str(BIN / "sluice-balancer"), "--port", "0", "--node-id", "test-balancer"]
        argv += ["--backend", a.address, "--backend", b.address, "--models-refresh-s", "0.2"]
        balancer = stack.enter_context(running(argv))
        wait_health(
            balancer.address,
            lambda h: len(h.backends) == 2 and all(b.models for b in h.backends),
            "the balancer to learn both servers' models",
        )
        yield Fleet(a, b, balancer)


def digit(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 16, (1, 64)).astype(np.float32)


def predict(
    channel: grpc.Channel, x: np.ndarray, model: str = "", version: str = ""
) -> tuple[pb.PredictResponse, str]:
    """A Predict through `channel`: the reply and the node that answered (x-node-id)."""
    body = pb.PredictRequest(
        inputs=[codec.encode("input", x)], model=model, version=version
    ).SerializeToString()
    reply, call = channel.unary_unary("/sluice.v1.Inference/Predict").with_call(body, timeout=10)
    return pb.PredictResponse.FromString(reply), dict(call.trailing_metadata())["x-node-id"]


def test_the_balancer_lists_each_servers_models(fleet: Fleet) -> None:
    with SluiceClient(fleet.balancer.address) as client:
        health = client.health()
    assert [(m.name, list(m.versions), m.default) for m in health.models] == [
        ("alpha", ["1"], False),
        ("beta", ["1"], False),
        ("digits", ["1"], True),
    ]
    listed = {b.address: {m.name for m in b.models} for b in health.backends}
    assert listed == {fleet.a.address: SERVES["server-a"], fleet.b.address: SERVES["server-b"]}
    with SluiceClient(fleet.balancer.address) as client:
        alpha = client.health(model="alpha")  # one model's health: the servers serving it
        with pytest.raises(grpc.RpcError) as unknown:
            client.health(model="gamma")
    assert alpha.status == "SERVING" and [m.name for m in alpha.models] == ["alpha"]
    assert [b.address for b in alpha.backends] == [fleet.a.address]
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_each_call_lands_on_a_server_that_serves_its_model(fleet: Fleet) -> None:
    with grpc.insecure_channel(fleet.balancer.address) as channel:
        for model, only in (("alpha", "server-a"), ("beta", "server-b")):
            for i in range(20):
                reply, node = predict(channel, digit(100 + i), model)
                assert node == only, f"{model} went to {node}"
                assert reply.model == model and reply.version == "1"
            _, node = predict(channel, digit(7), model, version="1")
            assert node == only


def test_a_model_both_serve_spreads_by_affinity(fleet: Fleet) -> None:
    nodes: dict[int, Counter[str]] = {i: Counter() for i in range(20)}
    with grpc.insecure_channel(fleet.balancer.address) as channel:
        for _ in range(3):
            for i in nodes:
                for model in ("digits", ""):  # named, and the agreed default
                    reply, node = predict(channel, digit(500 + i), model)
                    assert reply.model == "digits"
                    nodes[i][f"{model}:{node}"] += 1
    for i, seen in nodes.items():  # identical calls meet on one server
        assert all(count == 3 for count in seen.values()), f"input {i}: {dict(seen)}"
    used = {key.split(":")[1] for seen in nodes.values() for key in seen}
    assert used == {"server-a", "server-b"}


def test_an_unknown_model_or_version_is_not_found(fleet: Fleet) -> None:
    with grpc.insecure_channel(fleet.balancer.address) as channel:
        for model, version, says in [
            ("gamma", "", "model 'gamma'"),
            ("alpha", "7", "model 'alpha' version '7'"),
        ]:
            with pytest.raises(grpc.RpcError) as caught:
                predict(channel, digit(1), model, version)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert f"no server behind this balancer serves {says}" in str(caught.value.details())


def test_metadata_comes_from_a_server_that_serves_the_model(fleet: Fleet) -> None:
    with grpc.insecure_channel(fleet.balancer.address) as channel:
        metadata = channel.unary_unary("/sluice.v1.Inference/Metadata")
        reply = pb.MetadataResponse.FromString(
            metadata(pb.MetadataRequest(model="beta").SerializeToString(), timeout=10)
        )
        assert reply.model.name == "beta"
        assert {m.name for m in reply.models} == SERVES["server-b"]
        with pytest.raises(grpc.RpcError) as caught:
            metadata(pb.MetadataRequest(model="gamma").SerializeToString(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def outputs(response: kpb.ModelInferResponse) -> dict[str, np.ndarray]:
    found = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        dtype = DATATYPES[tensor.datatype].dtype
        found[tensor.name] = np.frombuffer(raw, dtype=dtype).reshape(tuple(tensor.shape))
    return found


def test_model_infer_through_the_balancer_matches_onnxruntime(
    fleet: Fleet, reference: ort.InferenceSession
) -> None:
    infer_method = f"{KSERVE}/ModelInfer"
    with grpc.insecure_channel(fleet.balancer.address) as channel:
        infer = channel.unary_unary(infer_method)
        for sample in SAMPLES:
            x = sample.input
            request = kpb.ModelInferRequest(
                model_name="beta",
                id=f"call-{sample.label}",
                inputs=[
                    kpb.ModelInferRequest.InferInputTensor(
                        name="input", datatype="FP32", shape=list(x.shape)
                    )
                ],
                raw_input_contents=[x.tobytes()],
            )
            body, call = infer.with_call(request.SerializeToString(), timeout=10)
            assert dict(call.trailing_metadata())["x-node-id"] == "server-b"
            response = kpb.ModelInferResponse.FromString(body)
            assert response.model_name == "beta" and response.id == f"call-{sample.label}"
            label, probabilities = reference.run(None, {"input": x})
            got = outputs(response)
            np.testing.assert_array_equal(got["label"], label)
            np.testing.assert_array_equal(got["probabilities"], probabilities)
        with pytest.raises(grpc.RpcError) as caught:
            infer(kpb.ModelInferRequest(model_name="gamma").SerializeToString(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def kserve(channel: grpc.Channel, method: str, request: Message, kind: type[M]) -> M:
    body = channel.unary_unary(f"{KSERVE}/{method}")(request.SerializeToString(), timeout=10)
    return kind.FromString(body)


def test_kserve_server_and_model_calls_through_the_balancer(fleet: Fleet) -> None:
    with grpc.insecure_channel(fleet.balancer.address) as channel:
        assert kserve(channel, "ServerLive", kpb.ServerLiveRequest(), kpb.ServerLiveResponse).live
        ready = kserve(channel, "ServerReady", kpb.ServerReadyRequest(), kpb.ServerReadyResponse)
        assert ready.ready
        meta = kserve(
            channel, "ServerMetadata", kpb.ServerMetadataRequest(), kpb.ServerMetadataResponse
        )
        assert meta.name == "sluice-balancer" and meta.version
        for name, expected in (("alpha", True), ("beta", True), ("gamma", False)):
            request = kpb.ModelReadyRequest(name=name)
            got = kserve(channel, "ModelReady", request, kpb.ModelReadyResponse)
            assert got.ready is expected, name
        model = kserve(
            channel,
            "ModelMetadata",
            kpb.ModelMetadataRequest(name="alpha"),
            kpb.ModelMetadataResponse,
        )
        assert model.name == "alpha" and [t.name for t in model.inputs] == ["input"]
        with pytest.raises(grpc.RpcError) as caught:
            request = kpb.ModelMetadataRequest(name="gamma")
            kserve(channel, "ModelMetadata", request, kpb.ModelMetadataResponse)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_server_back_with_other_models_is_learned_at_once() -> None:
    """The refresh period is long: only the news that the server serves again can teach
    the balancer its new models in time."""
    with ExitStack() as stack:
        first = stack.enter_context(running(model_argv("server-a", "digits", "alpha")))
        argv = [str(BIN / "sluice-balancer"), "--port", "0", "--node-id", "test-balancer"]
        argv += ["--backend", first.address, "--models-refresh-s", "60"]
        balancer = stack.enter_context(running(argv))

        def serves(h: pb.HealthResponse) -> set[str]:
            return {m.name for b in h.backends for m in b.models}

        wait_health(balancer.address, lambda h: serves(h) == SERVES["server-a"], "alpha")
        first.kill()
        port = first.address.rsplit(":", 1)[1]
        again = [*model_argv("server-a2", "digits", "gamma"), "--port", port]
        stack.enter_context(running(again))
        wait_health(
            balancer.address,
            lambda h: serves(h) == {"digits", "gamma"},
            "the balancer to learn the new models",
            timeout=10,
        )
        with grpc.insecure_channel(balancer.address) as channel:
            assert predict(channel, digit(3), "gamma")[1] == "server-a2"
            with pytest.raises(grpc.RpcError) as caught:
                predict(channel, digit(3), "alpha")
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_model_unloaded_on_one_server_moves_to_the_other_without_a_failed_call(
    tmp_path: Path,
) -> None:
    """The balancer still believes server A serves alpha (its refresh period is long): the
    call A refuses with NOT_FOUND goes on to B, and that refusal makes it ask A at once."""
    repositories = []
    for node in ("a", "b"):
        repository = tmp_path / node
        for name in ("digits", "alpha"):
            (repository / name / "1").mkdir(parents=True)
            (repository / name / "1" / "model.onnx").write_bytes(models.DIGITS.read_bytes())
        repositories.append(repository)
    watch = ("--repository-poll-s", "0.1", "--default-model", "digits")
    with ExitStack() as stack:
        a, b = (
            stack.enter_context(
                running(server_argv("--model-repository", str(r), *watch, node_id=f"server-{n}"))
            )
            for r, n in zip(repositories, "ab", strict=True)
        )
        argv = [str(BIN / "sluice-balancer"), "--port", "0", "--node-id", "test-balancer"]
        argv += ["--backend", a.address, "--backend", b.address, "--models-refresh-s", "60"]
        balancer = stack.enter_context(running(argv))

        def alpha_on(h: pb.HealthResponse) -> set[str]:
            return {s.address for s in h.backends if "alpha" in {m.name for m in s.models}}

        wait_health(balancer.address, lambda h: alpha_on(h) == {a.address, b.address}, "alpha")
        shutil.rmtree(repositories[0] / "alpha")
        wait_health(a.address, lambda h: "alpha" not in {m.name for m in h.models}, "unload")
        with grpc.insecure_channel(balancer.address) as channel:
            nodes = Counter(predict(channel, digit(900 + i), "alpha")[1] for i in range(20))
        assert nodes == {"server-b": 20}
        refused = wait_health(a.address, lambda h: True, "a health report")
        assert refused.errors_by_code["NOT_FOUND"] >= 1  # one went there, and on to B
        learned = wait_health(balancer.address, lambda h: alpha_on(h) == {b.address}, "relearn")
        assert learned.balancer.unavailable == 0


def test_model_infer_rides_the_balancers_predict_stream_too(fleet: Fleet) -> None:
    x = SAMPLES[0].input
    infer = kpb.ModelInferRequest(
        model_name="alpha",
        inputs=[
            kpb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[1, 64])
        ],
        raw_input_contents=[x.tobytes()],
    ).SerializeToString()
    messages = [
        pb.StreamRequest(id=1, request=infer, method="ModelInfer", timeout_s=10),
        pb.StreamRequest(id=2, request=infer, method="Explain", timeout_s=10),
    ]
    with grpc.insecure_channel(fleet.balancer.address) as channel:
        call = channel.stream_stream("/sluice.v1.Inference/PredictStream")
        replies = {
            r.id: r
            for r in map(
                pb.StreamResponse.FromString,
                call(iter(m.SerializeToString() for m in messages), timeout=10),
            )
        }
    assert replies[1].code == 0 and replies[1].trailers["x-node-id"] == "server-a"
    assert kpb.ModelInferResponse.FromString(replies[1].response).model_name == "alpha"
    assert replies[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "no method 'Explain'" in replies[2].message
