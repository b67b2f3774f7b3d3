"""Fan-out through a real balancer (`--fanout-rows`) in front of real servers: a many-row
Predict comes back equal to ONNX Runtime on the whole batch after its chunks ran on several
servers; one under the threshold goes whole, untouched; a chunk's failure fails the call
with its status; chunks answered by different model versions abort the call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from sluice.client import SluiceClient
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.conftest import scale_model
from tests.e2e.harness import Process, balancer_argv, running, server_argv, wait_health

pytestmark = pytest.mark.e2e

FANOUT_ROWS = 16


@dataclass
class Fleet:
    servers: list[Process]
    balancer: Process

    def computed(self) -> int:
        """Predict calls the servers have taken, all together."""
        total = 0
        for server in self.servers:
            with SluiceClient(server.address) as client:
                total += client.health().requests
        return total


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Three servers of the bundled digits model behind a balancer that fans out."""
    with ExitStack() as stack:
        servers = [
            stack.enter_context(running(server_argv(node_id=f"server-{i}"))) for i in range(3)
        ]
        extra = ("--fanout-rows", str(FANOUT_ROWS))
        balancer = stack.enter_context(
            running(balancer_argv(*(s.address for s in servers), extra=extra))
        )
        yield Fleet(servers, balancer)


def digits(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 16, (rows, 64)).astype(np.float32)


def test_a_many_row_request_fans_out_and_equals_onnxruntime_on_the_whole_batch(
    fleet: Fleet, reference: ort.InferenceSession
) -> None:
    x = digits(100, seed=1)
    before = fleet.computed()
    with SluiceClient(fleet.balancer.address) as client:
        answer = client.infer({"input": x}, request_id="fan-1")
    label, probabilities = reference.run(["label", "probabilities"], {"input": x})
    np.testing.assert_array_equal(answer.outputs["label"], label)
    np.testing.assert_allclose(answer.outputs["probabilities"], probabilities, rtol=1e-6)
    nodes = answer.node_id.split(",")
    assert len(nodes) == 7  # ceil(100 / 16) chunks, each answered by a server
    assert set(nodes) == {f"server-{i}" for i in range(3)}, nodes  # spread over all three
    assert answer.request_id == "fan-1"
    assert fleet.computed() - before == 7


def test_a_request_under_the_threshold_goes_whole(
    fleet: Fleet, reference: ort.InferenceSession
) -> None:
    x = digits(FANOUT_ROWS, seed=2)
    before = fleet.computed()
    with SluiceClient(fleet.balancer.address) as client:
        first = client.infer({"input": x})
        again = client.infer({"input": x})
    np.testing.assert_array_equal(first.outputs["label"], reference.run(["label"], {"input": x})[0])
    assert fleet.computed() - before == 2
    # Whole, so by its affinity key: the same body meets its cached answer on one server.
    assert first.node_id in {f"server-{i}" for i in range(3)}
    assert again.node_id == first.node_id and again.metadata["x-cache"] == "hit"


def test_a_many_row_message_on_a_predict_stream_fans_out_too(
    fleet: Fleet, reference: ort.InferenceSession
) -> None:
    x = digits(40, seed=3)
    message = pb.StreamRequest(
        id=9,
        request=pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString(),
        timeout_s=30,
    )
    with grpc.insecure_channel(fleet.balancer.address) as channel:
        stream = channel.stream_stream(
            "/sluice.v1.Inference/PredictStream",
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.StreamResponse.FromString,
        )
        (reply,) = list(stream(iter([message]), timeout=60))
    assert (reply.id, reply.code) == (9, 0), reply.message
    outputs = codec.decode_all(pb.PredictResponse.FromString(reply.response).outputs)
    np.testing.assert_array_equal(outputs["label"], reference.run(["label"], {"input": x})[0])
    assert len(reply.trailers["x-node-id"].split(",")) == 3  # ceil(40 / 16)


@contextmanager
def fanning_balancer(tmp_path: Path, *served: tuple[int, bytes]) -> Iterator[Process]:
    """A balancer fanning out by 4 rows in front of one server per (version, model file) of
    model `m`, once it has learned that each serves `m`."""
    with ExitStack() as stack:
        servers = []
        for n, (version, model) in enumerate(served):
            folder = tmp_path / f"server-{n}" / "m" / str(version)
            folder.mkdir(parents=True)
            (folder / "model.onnx").write_bytes(model)
            argv = server_argv("--model-repository", str(folder.parents[1]), node_id=f"server-{n}")
            servers.append(stack.enter_context(running(argv)))
        extra = ("--fanout-rows", "4", "--models-refresh-s", "0.2")
        balancer = stack.enter_context(
            running(balancer_argv(*(s.address for s in servers), extra=extra))
        )
        wait_health(
            balancer.address,
            lambda h: all(any(m.name == "m" for m in b.models) for b in h.backends),
            "the balancer to learn what each server serves",
        )
        yield balancer


def predict(balancer: Process, x: np.ndarray, version: str = "") -> pb.PredictResponse:
    """A Predict of `x` for model m, unary, as raw protobuf."""
    body = pb.PredictRequest(inputs=[codec.encode("x", x)], model="m", version=version)
    with grpc.insecure_channel(balancer.address) as channel:
        call = channel.unary_unary(
            "/sluice.v1.Inference/Predict",
            request_serializer=pb.PredictRequest.SerializeToString,
            response_deserializer=pb.PredictResponse.FromString,
        )
        response: pb.PredictResponse = call(body, timeout=30)
    return response


def test_a_chunk_a_server_refuses_fails_the_call_with_its_status(tmp_path: Path) -> None:
    """Both servers serve model m, version 1, but the second's takes 3 columns, not 4: only
    the chunks that land there are refused. Two backends: least loaded puts the chunks on
    both, so the call fails as the second server says."""
    x = np.ones((16, 4), np.float32)
    served = ((1, scale_model(2.0, width=4)), (1, scale_model(2.0, width=3)))
    with fanning_balancer(tmp_path, *served) as balancer, pytest.raises(grpc.RpcError) as caught:
        predict(balancer, x)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert details.startswith("chunk ") and "of 4 (rows " in details, details
    assert "--fanout-rows" in details and "'x'" in details


def test_chunks_answered_by_different_versions_abort_the_call(tmp_path: Path) -> None:
    """One server has version 1 of m (x2), the other version 2 (x3), as during a rolling
    update: a call naming no version is not merged from both; one naming 1 is."""
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    with fanning_balancer(tmp_path, (1, scale_model(2.0)), (2, scale_model(3.0))) as balancer:
        with pytest.raises(grpc.RpcError) as caught:
            predict(balancer, x)
        pinned = predict(balancer, x, version="1")
    assert caught.value.code() == grpc.StatusCode.ABORTED
    assert "different model versions" in (caught.value.details() or "")
    assert pinned.version == "1"
    np.testing.assert_array_equal(codec.decode_all(pinned.outputs)["y"], x * 2)
