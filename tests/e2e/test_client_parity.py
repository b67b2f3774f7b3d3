"""Both clients, one body: each case runs through the blocking and the asyncio driver against
real servers, and must come out the same (options, errors, deadlines, routing, hedging)."""

from __future__ import annotations

import asyncio
import inspect
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import grpc
import numpy as np
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from tests.e2e.harness import Process, running, server_argv

pytestmark = pytest.mark.e2e

DEAD = "127.0.0.1:1"  # nothing listens there


class Blocking:
    """The blocking client as it is."""

    def __init__(self, target: str | list[str], **options: Any) -> None:
        self.client = SluiceClient(target, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def close(self) -> None:
        self.client.close()


class Asyncio:
    """The asyncio client on a loop of its own, each coroutine method run to its end."""

    def __init__(self, target: str | list[str], **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = self.loop.run_until_complete(self._made(target, options))

    @staticmethod
    async def _made(target: str | list[str], options: dict[str, Any]) -> AsyncSluiceClient:
        return AsyncSluiceClient(target, **options)

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.client, name)
        if not inspect.iscoroutinefunction(found):
            return found
        return lambda *args, **kwargs: self.loop.run_until_complete(found(*args, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


Connect = Callable[..., Any]


@pytest.fixture(params=[Blocking, Asyncio], ids=["blocking", "asyncio"])
def connect(request: pytest.FixtureRequest) -> Iterator[Connect]:
    """Opens a client of the driver under test; each is closed after the test."""
    opened: list[Any] = []

    def make(target: str | list[str], **options: Any) -> Any:
        opened.append(request.param(target, **options))
        return opened[-1]

    yield make
    for client in opened:
        client.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[list[Process]]:
    with ExitStack() as stack:
        yield [stack.enter_context(running(server_argv(node_id=f"server-{i}"))) for i in range(3)]


@contextmanager
def stopped(proc: Process) -> Iterator[None]:
    proc.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.proc.send_signal(signal.SIGCONT)  # never leave a stopped process behind


def digit(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 16, (1, 64)).astype(np.float32)


def test_predict_and_infer_answer_alike(connect: Connect, servers: list[Process]) -> None:
    client = connect(servers[0].address)
    outputs = client.predict({"input": digit(1)})
    answer = client.infer({"input": digit(1)})
    assert set(outputs) == set(answer.outputs) == {"label", "probabilities"}
    for name, array in outputs.items():
        np.testing.assert_array_equal(array, answer.outputs[name])
    assert answer.node_id == "server-0"
    assert len(answer.request_id) == 16  # one made up when none is given


def test_infer_takes_the_shared_options(connect: Connect, servers: list[Process]) -> None:
    client = connect(servers[0].address)
    answer = client.infer(
        {"input": digit(2)}, outputs=["label"], request_id="parity-1", model="", version=""
    )
    assert set(answer.outputs) == {"label"}
    assert answer.request_id == "parity-1"
    plain = client.infer({"input": digit(2).tolist()}, outputs=["label"])  # a plain value
    np.testing.assert_array_equal(plain.outputs["label"], answer.outputs["label"])


def test_no_cache_computes_every_call(connect: Connect, servers: list[Process]) -> None:
    client = connect(servers[0].address)
    x = {"input": digit(3)}
    client.predict(x)
    before = client.health().batcher.requests
    client.predict(x)  # a cache hit: not computed
    client.predict(x, no_cache=True)
    client.predict(x, no_cache=True)
    assert client.health().batcher.requests == before + 2


def test_metadata_and_health(connect: Connect, servers: list[Process]) -> None:
    client = connect(servers[1].address)
    meta = client.metadata()
    assert [(t.name, t.datatype) for t in meta.model.inputs] == [("input", "FP32")]
    health = client.health()
    assert (health.node_id, health.status, health.role) == ("server-1", "SERVING", "server")


def test_a_bad_input_raises_invalid_argument(connect: Connect, servers: list[Process]) -> None:
    client = connect(servers[0].address)
    with pytest.raises(grpc.RpcError) as caught:
        client.predict({"input": np.zeros((1, 3), np.float32)})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "64" in (caught.value.details() or "")


def test_a_call_runs_out_of_its_deadline(connect: Connect, servers: list[Process]) -> None:
    client = connect(servers[2].address, timeout=5.0)
    client.predict({"input": digit(4)})  # connected before the stop
    with stopped(servers[2]):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            client.predict({"input": digit(5)}, timeout=0.3)
        took = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert took < 3.0


def test_several_servers_are_routed_past_one_down(connect: Connect, servers: list[Process]) -> None:
    client = connect([*(s.address for s in servers), DEAD], timeout=5.0)
    nodes = {client.infer({"input": digit(100 + i)}).node_id for i in range(30)}
    assert len(nodes) >= 2 and nodes <= {"server-0", "server-1", "server-2"}
    assert client.metadata().model.inputs[0].name == "input"  # passed over the dead one too


def test_hedging_answers_a_stopped_servers_calls(connect: Connect, servers: list[Process]) -> None:
    # Keepalive long: only a hedge can answer the stopped server's calls before the deadline.
    targets = [s.address for s in servers]
    client = connect(targets, timeout=8.0, hedge_after_ms=100, keepalive_s=60)
    owned = []  # inputs whose ring owner is server-0: keyed calls go there first
    for seed in range(100):  # connected to every server, and a tenth of a hedge a call earned
        if client.infer({"input": digit(seed)}).node_id == "server-0":
            owned.append(seed)
    assert owned
    with stopped(servers[0]):
        for seed in owned[:5]:
            started = time.monotonic()
            answer = client.infer({"input": digit(seed)})
            assert answer.node_id != "server-0"
            assert time.monotonic() - started < 4.0  # half the deadline a stuck call runs out
    router = client._router
    assert router is not None and router.hedging is not None and router.hedging.won >= 1
