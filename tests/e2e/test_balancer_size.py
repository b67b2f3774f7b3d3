"""A request over a server's message limit, sent through a balancer whose own limit is larger:
the balancer answers RESOURCE_EXHAUSTED naming the server's limit and the flag that raises
it, tries no other backend, and never writes it on the stream it shares with other calls
(the server would end that stream, and every call on it with it). Real balancer, real
server: 1 MiB on the server, 8 MiB on the balancer."""

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
from tests.e2e.harness import Process, running, server_argv, wait_health

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
def pair(deep: Path) -> Iterator[Pair]:
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


def test_an_oversized_call_is_refused_naming_the_servers_limit(pair: Pair) -> None:
    retries = wait_health(pair.balancer.address, lambda h: True, "health").balancer.retries
    with SluiceClient(pair.balancer.address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.predict({"input": rows(OVER, seed=1)})
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        said = refused.value.details() or ""
        assert f"over the limit of the server at {pair.server.address} ({SERVER_LIMIT}" in said
        assert "--max-message-bytes" in said and "SLUICE_MAX_MESSAGE_BYTES" in said, said
        assert "no backend can take the call" not in said, said
        client.predict({"input": rows(1, seed=2)})  # the server serves on
    health = wait_health(pair.balancer.address, lambda h: True, "health")
    assert health.balancer.retries == retries  # not retried
    assert [b.failures for b in health.backends] == [0]  # no fault of the server's


async def test_an_oversized_call_harms_no_call_in_flight(pair: Pair) -> None:
    """Long calls are in flight on the balancer's stream to the server (one instance: they
    queue there for seconds) when an oversized one comes: it is refused, they are answered."""
    async with AsyncSluiceClient(pair.balancer.address, timeout=120) as client:
        slow = [
            asyncio.create_task(client.predict({"input": rows(SLOW, seed=seed)}))
            for seed in range(10, 10 + QUEUED)
        ]
        await asyncio.to_thread(
            wait_health, pair.server.address, lambda h: h.in_flight >= 1, "the long calls"
        )
        with pytest.raises(grpc.RpcError) as refused:
            await client.predict({"input": rows(OVER, seed=4)})
        # First what the oversized call did to them: before, it ended their stream.
        answers = await asyncio.gather(*slow, return_exceptions=True)
        for answer in answers:
            assert isinstance(answer, dict), answer
            assert answer["output"].shape == (SLOW, 10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value


def test_a_request_at_the_limit_goes_through(pair: Pair) -> None:
    """The balancer's check counts what the server receives (the request in its stream
    message), no more: a request just under the server's limit is served."""
    count = (SERVER_LIMIT - 1024) // ROW
    with SluiceClient(pair.balancer.address, timeout=120) as client:
        answer = client.predict({"input": rows(count, seed=5)})
        assert answer["output"].shape == (count, 10)


def test_a_refusal_is_no_word_on_the_server(pair: Pair) -> None:
    """A request refused at the balancer never reached the server: it is not one of the
    server's calls, and its near-zero time is no latency sample of the server's."""
    before = wait_health(pair.balancer.address, lambda h: True, "health")
    with (
        SluiceClient(pair.balancer.address, timeout=60) as client,
        pytest.raises(grpc.RpcError) as refused,
    ):
        client.predict({"input": rows(OVER, seed=6)})
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    after = wait_health(pair.balancer.address, lambda h: True, "health")
    assert after.requests == before.requests + 1  # the balancer answered it
    [was], [now] = before.backends, after.backends
    assert (now.calls, now.failures, now.in_flight) == (was.calls, was.failures, 0)
    assert after.balancer.calls == before.balancer.calls
