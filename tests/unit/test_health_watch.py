"""grpc.health.v1 Watch: the status now and at each change; at shutdown every watcher is told
NOT_SERVING and its stream ends, one opened after it too (none left for grpc's grace)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.runtime.health import NOT_SERVING, SERVING, HealthService

REQUEST = health_pb2.HealthCheckRequest()


@pytest.fixture
async def watched() -> AsyncIterator[tuple[HealthService, health_pb2_grpc.HealthStub]]:
    health = HealthService()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield health, health_pb2_grpc.HealthStub(channel)
    finally:
        await server.stop(0)


async def _statuses(call: grpc.aio.UnaryStreamCall, count: int) -> list[int]:
    return [(await call.read()).status for _ in range(count)]  # type: ignore[union-attr]


async def test_a_watcher_sees_each_change_then_the_shutdown_ends_its_stream(
    watched: tuple[HealthService, health_pb2_grpc.HealthStub],
) -> None:
    health, stub = watched
    call = stub.Watch(REQUEST)
    assert await asyncio.wait_for(_statuses(call, 1), 10) == [SERVING]
    await health.set("", NOT_SERVING)
    assert await asyncio.wait_for(_statuses(call, 1), 10) == [NOT_SERVING]
    await health.set("", SERVING)
    assert await asyncio.wait_for(_statuses(call, 1), 10) == [SERVING]
    await health.shut_down()
    assert await asyncio.wait_for(_statuses(call, 1), 10) == [NOT_SERVING]
    assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK


async def test_a_watch_opened_after_the_shutdown_says_not_serving_and_ends(
    watched: tuple[HealthService, health_pb2_grpc.HealthStub],
) -> None:
    health, stub = watched
    await health.shut_down()
    await health.set("", SERVING)  # ignored once shut down
    call = stub.Watch(REQUEST)
    assert await asyncio.wait_for(_statuses(call, 1), 10) == [NOT_SERVING]
    assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK
    check = await stub.Check(REQUEST, timeout=10)
    assert check.status == NOT_SERVING
