"""A reply over a server's message limit: that call alone is answered RESOURCE_EXHAUSTED,
naming the limit and the flag that raises it, and the stream it came on goes on with every
other call on it (grpc at the server would end the stream for the reply it could not
send). A direct unary call gets the same words, not grpc's. Real balancer, real server:
1 MiB on the server, 8 MiB on the balancer; two models on the server, a deep MLP whose
calls stay in flight a while and a doubler whose replies are twice its requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from perf.make_mlp import build
from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.runtime.launch import BIN
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.e2e.harness import Process, running, server_argv, wait_health

pytestmark = pytest.mark.e2e

SERVER_LIMIT = 1024 * 1024
BALANCER_LIMIT = 8 * 1024 * 1024
OVER = 200_000  # rows of the doubler: 0.8 MB asked, 1.6 MB answered
SLOW = 3500  # rows of the deep MLP: a third of a second each here
QUEUED = 8  # such calls at once: seconds of work queued at the server's one instance
PREDICT = "/sluice.v1.Inference/Predict"


@dataclass
class Pair:
    server: Process
    balancer: Process


def doubler() -> bytes:
    """y = [x, x] over FP32[N, 1] -> FP32[N, 2]: eight bytes of reply a row, four asked."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Concat", ["x", "x"], ["y"], axis=1)],
        "doubler",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


@pytest.fixture(scope="module")
def sized_hop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    folder = tmp_path_factory.mktemp("models")
    (folder / "deep.onnx").write_bytes(build(width=1024, depth=8))
    (folder / "doubler.onnx").write_bytes(doubler())
    models = (
        "--model",
        f"deep={folder / 'deep.onnx'}",
        "--model",
        f"doubler={folder / 'doubler.onnx'}",
    )
    limit = ("--max-message-bytes", str(SERVER_LIMIT))
    balancer_flags = ("--port", "0", "--max-message-bytes", str(BALANCER_LIMIT))
    with running(server_argv(*models, *limit)) as server:
        argv = [str(BIN / "sluice-balancer"), *balancer_flags, "--backend", server.address]
        with running(argv) as balancer:
            wait_health(balancer.address, lambda h: len(h.models) == 2, "the server's models")
            yield Pair(server, balancer)


def column(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (count, 1)).astype(np.float32)


def deep_rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (count, 64)).astype(np.float32)


def raw_predict(address: str, count: int) -> bytes:
    """The server's reply to a doubler call of `count` rows, as plain grpc sees it (no
    Sluice client between: what grpcurl or another language's client would get)."""
    body = pb.PredictRequest(
        model="doubler", inputs=codec.encode_all({"x": column(count, seed=count)})
    ).SerializeToString()
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        reply: bytes = call(body, timeout=60)
        return reply


def said_over_the_limit(error: grpc.RpcError) -> str:
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    said = error.details() or ""
    assert "the reply (" in said and f"over the limit of server test-node ({SERVER_LIMIT}" in said
    assert "--max-message-bytes" in said and "SLUICE_MAX_MESSAGE_BYTES" in said, said
    assert "larger than max" not in said, said  # our words, not grpc's
    return said


async def test_an_oversized_reply_harms_no_call_on_its_stream(sized_hop: Pair) -> None:
    """Long calls are in flight on the balancer's one stream to the server when a call
    whose reply is over the server's limit comes: it alone is refused, they are answered."""
    async with AsyncSluiceClient(sized_hop.balancer.address, timeout=120) as client:
        slow = [
            asyncio.create_task(client.predict({"input": deep_rows(SLOW, seed)}, model="deep"))
            for seed in range(10, 10 + QUEUED)
        ]
        await asyncio.to_thread(
            wait_health, sized_hop.server.address, lambda h: h.in_flight >= 1, "the long calls"
        )
        with pytest.raises(grpc.RpcError) as refused:
            await client.predict({"x": column(OVER, seed=1)}, model="doubler")
        answers = await asyncio.gather(*slow, return_exceptions=True)
        for answer in answers:
            assert isinstance(answer, dict), answer
            assert answer["output"].shape == (SLOW, 10)
        said_over_the_limit(refused.value)
        small = await client.predict({"x": column(3, seed=2)}, model="doubler")
        assert small["y"].shape == (3, 2)  # the stream serves on


def test_an_oversized_unary_reply_says_what_to_raise(sized_hop: Pair) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        raw_predict(sized_hop.server.address, OVER)
    said_over_the_limit(refused.value)
    assert pb.PredictResponse.FromString(raw_predict(sized_hop.server.address, 3)).outputs


def test_the_stream_counts_its_envelope(sized_hop: Pair) -> None:
    """A reply at most the limit goes as a unary reply; on a stream its envelope (id,
    trailers) is counted too: one that fits alone but not in its envelope is refused, one
    that fits in it is served. The reply's size grows by 8 bytes a row in this range."""
    probe = 100_000
    measured = len(raw_predict(sized_hop.server.address, probe))
    fits_alone = probe + (SERVER_LIMIT - measured) // 8  # its reply: the limit, at most 7 under
    assert len(raw_predict(sized_hop.server.address, fits_alone)) > SERVER_LIMIT - 8
    with SluiceClient(sized_hop.balancer.address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.predict({"x": column(fits_alone, seed=3)}, model="doubler")
        said_over_the_limit(refused.value)
        fits = fits_alone - 32  # 256 bytes for the envelope: more than it takes
        assert client.predict({"x": column(fits, seed=4)}, model="doubler")["y"].shape == (fits, 2)
