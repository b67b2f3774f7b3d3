"""One client core: the blocking client runs the async client's own methods on its private
loop, with no socket: the one transport step (`AsyncSluiceClient._send`) is faked."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.client.client import rpc_error
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from sluice.wire.mux import Reply

DEAD = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]  # never dialled: the transport is fake


class FakeServers:
    """Stands in for `AsyncSluiceClient._send`: answers by target, records each attempt."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.refuse: grpc.aio.AioRpcError | None = None
        self.sent: list[tuple[str, float | None, dict[str, str]]] = []
        self.threads: set[str] = set()

    async def send(
        self,
        target: str,
        body: bytes,
        metadata: tuple[tuple[str, str], ...],
        timeout: float | None,
    ) -> Reply:
        self.sent.append((target, timeout, dict(metadata)))
        self.threads.add(threading.current_thread().name)
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
    # A function, so it binds as a method: `self` is the client, dropped here.
    monkeypatch.setattr(AsyncSluiceClient, "_send", lambda client, *args: fake.send(*args))
    yield fake


def x() -> dict[str, np.ndarray]:
    return {"input": np.arange(4, dtype=np.float32).reshape(1, 4)}


def test_the_blocking_methods_are_the_async_ones() -> None:
    for name in ("predict", "infer", "health", "metadata"):
        method = getattr(SluiceClient, name)
        assert method.__wrapped__ is getattr(AsyncSluiceClient, name), name
        assert inspect.iscoroutinefunction(getattr(AsyncSluiceClient, name))
        assert not inspect.iscoroutinefunction(method)
        assert method.__doc__ == getattr(AsyncSluiceClient, name).__doc__


def test_the_blocking_client_runs_the_core_on_its_own_loop(servers: FakeServers) -> None:
    with SluiceClient(DEAD[0], timeout=3.0) as client:
        answer = client.infer(x(), request_id="r1")
        outputs = client.predict(x())
        assert isinstance(client._core, AsyncSluiceClient) and client._router is None
    np.testing.assert_array_equal(answer.outputs["input"], x()["input"] * 2)
    assert (answer.node_id, answer.request_id) == (DEAD[0], "r1")
    assert list(outputs) == ["input"]
    assert servers.threads == {"sluice-client"}  # not the caller's thread
    assert [(t, timeout) for t, timeout, _ in servers.sent] == [(DEAD[0], 3.0)] * 2
    assert not client._thread.is_alive()


def test_one_target_raises_grpcs_own_error(servers: FakeServers) -> None:
    servers.refuse = rpc_error(Reply(grpc.StatusCode.INVALID_ARGUMENT.value[0], "wrong rank"))
    with SluiceClient(DEAD[0]) as client, pytest.raises(grpc.RpcError) as caught:
        client.predict(x())
    assert caught.value is servers.refuse
    assert len(servers.sent) == 1  # one target: no retries, the balancer behind does those


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
