"""Overload through the balancer, on real processes: a server's refusal for want of capacity
teaches the balancer that server's limit, and while every server is at its limit the
balancer refuses at once instead of queueing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.e2e.harness import BIN, hold_the_instance, rows, running, server_argv

pytestmark = pytest.mark.e2e

PREDICT = "/sluice.v1.Inference/Predict"
BIG_ROWS = 64_000  # seconds of work for the one instance


async def test_the_balancer_learns_a_full_server_and_sheds_at_once(mlp: Path) -> None:
    argv = server_argv(
        "--instances", "1", "--max-batch", "1", "--cache-entries", "0", "--inline-max-us", "0",
        model=mlp,
    )  # fmt: skip
    small = pb.PredictRequest(inputs=[codec.encode("input", rows(1, seed=3)[0])])
    with running(argv) as server:
        balancer_argv = [str(BIN / "sluice-balancer"), "--port", "0", "--backend", server.address]
        with running(balancer_argv) as balancer:
            async with (
                AsyncSluiceClient(balancer.address, timeout=300) as client,
                grpc.aio.insecure_channel(balancer.address) as channel,
            ):
                holding = await hold_the_instance(
                    client, server.address, blocker_rows=BIG_ROWS, seed=1
                )
                predict = channel.unary_unary(
                    PREDICT, request_serializer=None, response_deserializer=None
                )
                failures = []
                for _ in range(2):  # refused by the server, then by the balancer alone
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await predict(small.SerializeToString(), timeout=0.5)
                    failures.append(refused.value)
                health = await client.health()
                server_health = await asyncio.to_thread(server_health_of, server.address)
                await holding
                after = await client.predict({"input": rows(1, seed=4)[0]})  # headroom again
    first, second = failures
    for failure in failures:
        assert failure.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("x-refused", "overloaded") in tuple(failure.trailing_metadata() or ())
    # The first is the server's own refusal (no other server to retry on); the second
    # never left the balancer.
    assert "cannot answer within the deadline" in (first.details() or "")
    assert "every backend is at its limit" in (second.details() or "")
    assert health.balancer.shed == 1  # the second
    assert health.backends[0].limit == 1  # it held the long call when it refused
    assert server_health.batcher.rejected == 1  # the second never reached it
    assert after["output"].shape == (1, 10)


def server_health_of(address: str) -> pb.HealthResponse:
    with SluiceClient(address) as client:
        return client.health()
