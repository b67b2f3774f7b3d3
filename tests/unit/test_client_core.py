"""One client core: both clients build, route and decode through the same code, and add
only the sending. No socket: the one transport step (`_send`) is faked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from sluice.client import AsyncSluiceClient, Prediction, SluiceClient
from sluice.client.core import rpc_error
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from sluice.wire.mux import Reply

DEAD = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]  # never dialled: the transport is fake


class FakeServers:
    """Stands in for the clients' one transport step (`_send`): answers by target and
    records each attempt."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.refuse: grpc.RpcError | None = None
        self.sent: list[tuple[str, float | None, dict[str, str]]] = []
        self.bodies: list[bytes] = []

    def send(
        self,
        target: str,
        body: bytes,
        metadata: tuple[tuple[str, str], ...],
        timeout: float | None,
    ) -> Reply:
        self.sent.append((target, timeout, dict(metadata)))
        self.bodies.append(body)
        if target in self.down:
            raise rpc_error(Reply(grpc.StatusCode.UNAVAILABLE.value[0], f"{target} is down"))
        if self.refuse is not None:
            raise self.refuse
        request = pb.PredictRequest.FromString(body)
        doubled = {t.name: codec.decode(t) * 2 for t in request.inputs}
        response = pb.PredictResponse(outputs=codec.encode_all(doubled))
        trailers = {"x-node-id": target, "x-request-id": dict(metadata)["x-request-id"]}
        return Reply(0, "", response.SerializeToString(), trailers)


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeServers]:
    fake = FakeServers()

    async def send_async(client: AsyncSluiceClient, *args: Any) -> Reply:
        return fake.send(*args)

    monkeypatch.setattr(AsyncSluiceClient, "_send", send_async)
    monkeypatch.setattr(SluiceClient, "_send", lambda client, *args: fake.send(*args))
    yield fake


def x() -> dict[str, np.ndarray]:
    return {"input": np.arange(4, dtype=np.float32).reshape(1, 4)}


def test_both_clients_build_route_and_decode_alike(servers: FakeServers) -> None:
    async def with_async() -> Prediction:
        async with AsyncSluiceClient(DEAD, timeout=3.0) as client:
            return await client.infer(x(), request_id="r1", no_cache=True)

    with SluiceClient(DEAD, timeout=3.0) as client:
        blocking = client.infer(x(), request_id="r1", no_cache=True)
    asynchronous = asyncio.run(with_async())
    for answer in (blocking, asynchronous):
        np.testing.assert_array_equal(answer.outputs["input"], x()["input"] * 2)
        assert answer.request_id == "r1" and answer.node_id in DEAD
    (_, first, sent_a), (_, second, sent_b) = servers.sent
    assert sent_a == sent_b == {"x-request-id": "r1", "x-cache-control": "no-cache"}
    assert first is not None and second is not None and 0 < first <= 3.0 and 0 < second <= 3.0


def test_both_clients_send_bodies_the_server_reads_in_place(servers: FakeServers) -> None:
    """Each tensor's raw bytes at a 64-byte boundary of the body: the server takes a view."""

    async def with_async() -> None:
        async with AsyncSluiceClient(DEAD) as client:
            await client.infer(x())

    with SluiceClient(DEAD) as client:
        client.infer(x())
    asyncio.run(with_async())
    assert len(servers.bodies) == 2
    for body in servers.bodies:
        decoded = codec.decode_predict(body)
        assert decoded is not None
        (array,) = decoded[0].values()
        assert np.shares_memory(array, np.frombuffer(body, np.uint8))


def test_one_target_raises_grpcs_own_error(servers: FakeServers) -> None:
    servers.refuse = rpc_error(Reply(grpc.StatusCode.INVALID_ARGUMENT.value[0], "wrong rank"))
    with SluiceClient(DEAD[0]) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict(x())
    assert caught.value is servers.refuse
    assert len(servers.sent) == 1  # one target: no retries, the balancer behind does those
    assert servers.sent[0][1] == 10.0  # the client's timeout, whole


def test_several_targets_route_through_the_planner(servers: FakeServers) -> None:
    with SluiceClient(DEAD, timeout=2.0) as client:
        assert client._router is not None
        owners = {i: client.infer(x(), no_cache=True).node_id for i in range(30)}
        assert set(owners.values()) == set(DEAD)  # least loaded spreads uncached calls
        servers.down = {client.infer(x()).node_id}  # this input's owner goes down
        servers.sent.clear()
        answer = client.infer(x())
        pool = client._router.pool
    (dead,) = servers.down
    assert answer.node_id != dead
    assert [t for t, _, _ in servers.sent] == [dead, answer.node_id]
    first, retry = (timeout for _, timeout, _ in servers.sent)
    assert first is not None and retry is not None and retry <= first <= 2.0  # the time left
    assert pool.backends[dead].failures == 1
    assert client._router.budget.retries == 1


def test_when_no_target_can_answer_the_error_says_why(servers: FakeServers) -> None:
    servers.down = set(DEAD)
    with SluiceClient(DEAD) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict(x())
    assert isinstance(caught.value, grpc.aio.AioRpcError)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details().startswith("no backend can take the call: ")
    assert "is down" in caught.value.details()


def test_callers_errors_are_not_retried_over_several_targets(servers: FakeServers) -> None:
    servers.refuse = rpc_error(Reply(grpc.StatusCode.INVALID_ARGUMENT.value[0], "wrong rank"))
    with SluiceClient(DEAD) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict(x())
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "wrong rank"
    assert len(servers.sent) == 1
    assert client._router is not None
    assert all(b.failures == 0 for b in client._router.pool.backends.values())


async def test_the_async_core_gives_raw_replies(servers: FakeServers) -> None:
    body = pb.PredictRequest(inputs=codec.encode_all(x())).SerializeToString()
    async with AsyncSluiceClient(DEAD) as client:
        reply = await client.call_raw(body, {"x-request-id": "raw"}, timeout=1.0)
        assert reply.code == 0 and reply.trailers["x-request-id"] == "raw"
        servers.down = set(DEAD)
        reply = await client.call_raw(body, {"x-request-id": "raw"})
    assert reply.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert reply.message.startswith("no backend can take the call")
    async with AsyncSluiceClient(DEAD[0]) as single:
        reply = await single.call_raw(body, {"x-request-id": "raw"})
    assert reply.code == grpc.StatusCode.UNAVAILABLE.value[0]  # raised by grpc, returned here
    assert reply.message == f"{DEAD[0]} is down"


def test_no_target_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="at least one target"):
        SluiceClient([])


def test_a_closed_blocking_client_says_so() -> None:
    client = SluiceClient(DEAD[0])
    client.close()
    with pytest.raises(ValueError, match="closed channel"):
        client.predict(x())
