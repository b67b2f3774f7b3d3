"""A balancer whose one backend refuses connections says so, for the method that was called:
a Predict, a KServe ModelInfer and a Metadata each answer UNAVAILABLE naming the backend and
that it refuses connections (not `not_serving`, which is what a server says of itself), and
the balancer's log line says it too. The backend's port is held by a socket that is bound but
not listening, so every connect is refused and nothing else can take the port meanwhile."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from sluice.client import SluiceClient
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, Process, running, wait_for, wait_health

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def refusing() -> Iterator[str]:
    """An address whose every connect is refused: bound, never listening."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        host, port = held.getsockname()
        yield f"{host}:{port}"


@pytest.fixture(scope="module")
def balancer(refusing: str) -> Iterator[Process]:
    argv = [str(BIN / "sluice-balancer"), "--port", "0", "--backend", refusing]
    with running(argv, serving=False) as proc:  # no usable backend: it is not serving
        wait_health(
            proc.address,
            lambda h: [b.health for b in h.backends] == ["NOT_SERVING"],
            "the balancer to find its backend out",
        )
        yield proc


def refused(call: grpc.RpcError) -> str:
    assert isinstance(call, grpc.Call)
    assert call.code() == grpc.StatusCode.UNAVAILABLE, call
    details: str = call.details() or ""
    return details


def test_predict_names_the_backend_that_refuses_connections(
    balancer: Process, refusing: str
) -> None:
    with SluiceClient(balancer.address) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict({"input": SAMPLES[0].input}, timeout=30)
    details = refused(caught.value)
    assert (
        details == f"no backend can take the call: none is usable ({refusing} refuses connections)"
    )


def test_model_infer_names_the_backend_that_refuses_connections(
    balancer: Process, refusing: str
) -> None:
    x = SAMPLES[1].input
    request = kpb.ModelInferRequest(
        model_name="digits",
        inputs=[
            kpb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=x.shape)
        ],
        raw_input_contents=[np.ascontiguousarray(x).tobytes()],
    )
    with grpc.insecure_channel(balancer.address) as channel, pytest.raises(grpc.RpcError) as caught:
        kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    details = refused(caught.value)
    assert "Metadata" not in details and "not_serving" not in details
    assert f"{refusing} refuses connections" in details


def test_metadata_names_itself_and_the_backend_that_refuses_connections(
    balancer: Process, refusing: str
) -> None:
    with SluiceClient(balancer.address) as client, pytest.raises(grpc.RpcError) as caught:
        client.metadata(timeout=30)
    details = refused(caught.value)
    assert details == (
        "no backend can answer /sluice.v1.Inference/Metadata: "
        f"none is usable ({refusing} refuses connections)"
    )


def test_the_log_says_why_the_backend_is_out(balancer: Process, refusing: str) -> None:
    line = f"backend {refusing} is NOT_SERVING: refuses connections"
    wait_for(lambda: any(line in text for text in list(balancer.lines)), "the log line")
