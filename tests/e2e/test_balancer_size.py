"""A request over a server's message limit, sent through a balancer whose own limit is larger:
the balancer answers RESOURCE_EXHAUSTED naming the server's limit and the flag that raises
it, tries no other backend, and never writes it on the stream it shares with other calls
(the server would end that stream, and every call on it with it). Real balancer, real
server: 1 MiB on the server, 8 MiB on the balancer.

The other way round, a reply under the server's limit but over the balancer's (8 MiB on the
server, 1 MiB on the balancer): that call alone is answered RESOURCE_EXHAUSTED naming the
balancer's limit, and the client's stream to the balancer goes on with every other call on it
(the balancer's grpc would end it for the reply it could not send); a unary caller gets the
same words, not grpc's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from perf.make_mlp import build
from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.runtime.launch import BIN
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from sluice.wire.mux import MuxStream
from tests.e2e.harness import Process, running, server_argv, wait_health
from tests.e2e.test_reply_size import column, doubler, raw_predict

pytestmark = pytest.mark.e2e

SERVER_LIMIT = 1024 * 1024
BALANCER_LIMIT = 8 * 1024 * 1024
ROW = 64 * 4  # bytes of one FP32 row of the 64-wide models
OVER = 6000  # rows: ~1.5 MB, over the server's limit, under the balancer's
SLOW = 3500  # rows: under the server's limit; a third of a second for the deep MLP here
QUEUED = 8  # such calls at once: seconds of work queued at the server's one instance


@dataclass
class Pair:
    server: Process
    balancer: Process


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A deep MLP (34 MB): a call of SLOW rows keeps the server's instance a while."""
    path = tmp_path_factory.mktemp("models") / "mlp1024x8.onnx"
    path.write_bytes(build(width=1024, depth=8))
    return path


@pytest.fixture(scope="module")
def deep_hop(deep: Path) -> Iterator[Pair]:
    limit = ("--max-message-bytes", str(SERVER_LIMIT))
    balancer_flags = ("--port", "0", "--max-message-bytes", str(BALANCER_LIMIT))
    with running(server_argv(*limit, model=deep)) as server:
        argv = [str(BIN / "sluice-balancer"), *balancer_flags, "--backend", server.address]
        with running(argv) as balancer:
            # The balancer knows the server's models once it has heard its Health: the
            # same answer tells it the server's limit.
            wait_health(balancer.address, lambda h: bool(h.models), "the server's models")
            yield Pair(server, balancer)


def rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (count, 64)).astype(np.float32)


def test_an_oversized_call_is_refused_naming_the_servers_limit(deep_hop: Pair) -> None:
    retries = wait_health(deep_hop.balancer.address, lambda h: True, "health").balancer.retries
    with SluiceClient(deep_hop.balancer.address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.predict({"input": rows(OVER, seed=1)})
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        said = refused.value.details() or ""
        assert f"over the limit of the server at {deep_hop.server.address} ({SERVER_LIMIT}" in said
        assert "--max-message-bytes" in said and "SLUICE_MAX_MESSAGE_BYTES" in said, said
        assert "no backend can take the call" not in said, said
        client.predict({"input": rows(1, seed=2)})  # the server serves on
    health = wait_health(deep_hop.balancer.address, lambda h: True, "health")
    assert health.balancer.retries == retries  # not retried
    assert [b.failures for b in health.backends] == [0]  # no fault of the server's


async def test_an_oversized_call_harms_no_call_in_flight(deep_hop: Pair) -> None:
    """Long calls are in flight on the balancer's stream to the server (one instance: they
    queue there for seconds) when an oversized one comes: it is refused, they are answered."""
    async with AsyncSluiceClient(deep_hop.balancer.address, timeout=120) as client:
        slow = [
            asyncio.create_task(client.predict({"input": rows(SLOW, seed=seed)}))
            for seed in range(10, 10 + QUEUED)
        ]
        await asyncio.to_thread(
            wait_health, deep_hop.server.address, lambda h: h.in_flight >= 1, "the long calls"
        )
        with pytest.raises(grpc.RpcError) as refused:
            await client.predict({"input": rows(OVER, seed=4)})
        # First what the oversized call did to them: before, it ended their stream.
        answers = await asyncio.gather(*slow, return_exceptions=True)
        for answer in answers:
            assert isinstance(answer, dict), answer
            assert answer["output"].shape == (SLOW, 10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value


def test_a_request_at_the_limit_goes_through(deep_hop: Pair) -> None:
    """The balancer's check counts what the server receives (the request in its stream
    message), no more: a request just under the server's limit is served."""
    count = (SERVER_LIMIT - 1024) // ROW
    with SluiceClient(deep_hop.balancer.address, timeout=120) as client:
        answer = client.predict({"input": rows(count, seed=5)})
        assert answer["output"].shape == (count, 10)


def test_a_refusal_is_no_word_on_the_server(deep_hop: Pair) -> None:
    """A request refused at the balancer never reached the server: it is not one of the
    server's calls, and its near-zero time is no latency sample of the server's."""
    before = wait_health(deep_hop.balancer.address, lambda h: True, "health")
    with (
        SluiceClient(deep_hop.balancer.address, timeout=60) as client,
        pytest.raises(grpc.RpcError) as refused,
    ):
        client.predict({"input": rows(OVER, seed=6)})
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    after = wait_health(deep_hop.balancer.address, lambda h: True, "health")
    assert after.requests == before.requests + 1  # the balancer answered it
    [was], [now] = before.backends, after.backends
    assert (now.calls, now.failures, now.in_flight) == (was.calls, was.failures, 0)
    assert after.balancer.calls == before.balancer.calls


NARROW = 1024 * 1024  # the balancer's limit in `narrow`
WIDE = 8 * 1024 * 1024  # its server's
BIG_REPLY = 200_000  # rows of the doubler: 0.8 MB asked, 1.6 MB answered


@pytest.fixture(scope="module")
def narrow(deep: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A balancer whose limit (1 MiB) is under its server's (8 MiB)."""
    folder = tmp_path_factory.mktemp("doubler")
    (folder / "doubler.onnx").write_bytes(doubler())
    models = ("--model", f"deep={deep}", "--model", f"doubler={folder / 'doubler.onnx'}")
    limit = ("--max-message-bytes", str(WIDE))
    balancer_flags = ("--port", "0", "--max-message-bytes", str(NARROW))
    with running(server_argv(*models, *limit)) as server:
        argv = [
            str(BIN / "sluice-balancer"),
            *balancer_flags,
            *("--node-id", "test-balancer", "--backend", server.address),
        ]
        with running(argv) as balancer:
            wait_health(balancer.address, lambda h: len(h.models) == 2, "the server's models")
            yield Pair(server, balancer)


def over_the_balancers_limit(code: int, said: str) -> None:
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], said
    assert "the reply (" in said, said
    assert f"over the limit of balancer test-balancer ({NARROW})" in said, said
    assert "--max-message-bytes" in said and "SLUICE_MAX_MESSAGE_BYTES" in said, said


def body(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    return pb.PredictRequest(model=model, inputs=codec.encode_all(inputs)).SerializeToString()


async def test_a_reply_over_the_balancers_limit_harms_no_call_on_the_clients_stream(
    narrow: Pair,
) -> None:
    """Long calls are in flight on a client's one stream to the balancer when a call whose
    reply is over the balancer's limit comes back: it alone is refused, they are answered,
    and the stream serves on."""
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(narrow.balancer.address, options=options) as channel:
        mux = MuxStream(channel)
        slow = [
            asyncio.create_task(mux.call(body("deep", {"input": rows(SLOW, seed)}), {}, 120.0))
            for seed in range(20, 20 + QUEUED)
        ]
        await asyncio.to_thread(
            wait_health, narrow.server.address, lambda h: h.in_flight >= 1, "the long calls"
        )
        big = await mux.call(body("doubler", {"x": column(BIG_REPLY, seed=1)}), {}, 120.0)
        answers = await asyncio.gather(*slow, return_exceptions=True)
        over_the_balancers_limit(big.code, big.message)
        for answer in answers:
            assert not isinstance(answer, BaseException) and answer.code == 0, answer
            outputs = codec.decode_all(pb.PredictResponse.FromString(answer.body).outputs)
            assert outputs["output"].shape == (SLOW, 10)
        small = await mux.call(body("doubler", {"x": column(3, seed=2)}), {}, 60.0)
        assert small.code == 0, small  # the stream serves on
        await mux.close()


def test_a_unary_reply_over_the_balancers_limit_says_what_to_raise(narrow: Pair) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        raw_predict(narrow.balancer.address, BIG_REPLY)
    error = refused.value
    assert isinstance(error, grpc.Call)
    said = error.details() or ""
    over_the_balancers_limit(error.code().value[0], said)
    assert "larger than max" not in said, said  # our words, not grpc's
    health = wait_health(narrow.balancer.address, lambda h: True, "health")
    assert health.errors_by_code["RESOURCE_EXHAUSTED"] >= 1  # counted as the balancer's answer
