"""Three real servers behind a real balancer on 127.0.0.1: affinity, caching once, hostile
inputs, failure of a server under load, draining, discovery from a file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec
from tests.e2e.harness import (
    BIN,
    Cluster,
    balancer_argv,
    children,
    running,
    server_argv,
    start_cluster,
    wait_for,
    write_listing,
)
from tests.e2e.test_server_e2e import HOSTILE

pytestmark = pytest.mark.e2e


def digit(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 16, (1, 64)).astype(np.float32)


def computed(address: str) -> int:
    with SluiceClient(address) as client:
        return client.health().batcher.requests


def test_identical_inputs_meet_their_cached_answer_on_one_server(cluster: Cluster) -> None:
    inputs = [digit(1000 + i) for i in range(10)]
    before = sum(computed(s.address) for s in cluster.servers)
    nodes: dict[int, Counter[str]] = {i: Counter() for i in range(10)}
    with SluiceClient(cluster.balancer.address) as client:
        for _ in range(100):
            for i, x in enumerate(inputs):
                nodes[i][client.infer({"input": x}).node_id] += 1
    after = sum(computed(s.address) for s in cluster.servers)
    for i, seen in nodes.items():
        assert len(seen) == 1, f"input {i} was answered by {dict(seen)}"
    assert len({next(iter(seen)) for seen in nodes.values()}) > 1  # keys spread over servers
    assert after - before == 10  # each distinct result computed once, cluster-wide


def test_calls_with_one_affinity_key_go_to_one_server_and_keys_spread(cluster: Cluster) -> None:
    """`x-affinity-key` routes by the caller's key, not the body: different bodies with one
    key meet on one server, and different keys spread over the servers."""
    nodes: dict[str, Counter[str]] = {}
    with grpc.insecure_channel(cluster.balancer.address) as channel:
        predict = channel.unary_unary("/sluice.v1.Inference/Predict")
        for k in range(20):
            key = f"user-{k}"
            nodes[key] = Counter()
            for i in range(4):  # bodies of its own: routed by their digests, they would spread
                x = digit(3000 + 4 * k + i)
                body = pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString()
                _, call = predict.with_call(body, timeout=10, metadata=(("x-affinity-key", key),))
                nodes[key][dict(call.trailing_metadata())["x-node-id"]] += 1
    for key, seen in nodes.items():
        assert len(seen) == 1, f"the calls with key {key} went to {dict(seen)}"
    owners = Counter(next(iter(seen)) for seen in nodes.values())
    assert len(owners) > 1, f"20 keys all went to {owners}"


# The balancer forwards bodies without parsing them: one case of each of the server's checks
# (the model's, the tensor codec's) shows their status and message come back unchanged; the
# server e2e tests and the unit tests cover the cases themselves.
THROUGH_THE_BALANCER = ["wrong dimension", "byte length off by one"]


@pytest.mark.parametrize("case", THROUGH_THE_BALANCER, ids=lambda c: c.replace(" ", "-"))
def test_hostile_inputs_get_the_same_status_through_the_balancer(
    cluster: Cluster, case: str
) -> None:
    inputs, message = HOSTILE[case]
    request = pb.PredictRequest(inputs=inputs)
    outcomes = []
    for address in (cluster.servers[0].address, cluster.balancer.address):
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.InferenceStub(channel).Predict(request, timeout=10)
            outcomes.append((caught.value.code(), caught.value.details()))
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert message in outcomes[1][1]
    with SluiceClient(cluster.balancer.address) as client:  # and both still serve
        assert client.predict({"input": digit(2)})["label"].shape == (1,)


def test_random_bytes_through_the_balancer(cluster: Cluster) -> None:
    body = np.random.default_rng(7).bytes(512)
    with (
        grpc.insecure_channel(cluster.balancer.address) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        channel.unary_unary("/sluice.v1.Inference/Predict")(body, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpcurl_and_health_through_the_balancer(cluster: Cluster) -> None:
    def grpcurl(*args: str) -> str:
        return subprocess_output([str(BIN / "grpcurl"), "-plaintext", *args])

    assert "sluice.v1.Inference" in grpcurl(cluster.balancer.address, "list").split()
    body = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "fp32_data": [1] * 64}],
        "typed_outputs": True,
    }
    reply = json.loads(
        grpcurl("-d", json.dumps(body), cluster.balancer.address, "sluice.v1.Inference/Predict")
    )
    assert [t["name"] for t in reply["outputs"]] == ["label", "probabilities"]
    check = json.loads(grpcurl(cluster.balancer.address, "grpc.health.v1.Health/Check"))
    assert check == {"status": "SERVING"}
    health = cluster.health()
    assert health.role == "balancer" and health.status == "SERVING"
    assert sorted(b.address for b in health.backends) == sorted(s.address for s in cluster.servers)
    assert all(b.health == "SERVING" and b.breaker == "CLOSED" for b in health.backends)
    assert sum(b.share for b in health.backends) == pytest.approx(1.0)


def subprocess_output(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout


class Load:
    """Unique inputs through the balancer from `concurrency` workers until stopped (bounded in
    time and count); every failure is kept."""

    def __init__(self, address: str, concurrency: int = 12, limit_s: float = 60.0) -> None:
        self.address = address
        self.concurrency = concurrency
        self.limit_s = limit_s
        self.ok = 0
        self.failures: list[str] = []
        self.stop = asyncio.Event()
        self.nodes: Counter[str] = Counter()

    async def run(self) -> None:
        deadline = time.monotonic() + self.limit_s
        seed = iter(range(10**6))
        async with AsyncSluiceClient(self.address, timeout=10) as client:

            async def worker() -> None:
                while not self.stop.is_set() and time.monotonic() < deadline:
                    try:
                        answer = await client.infer({"input": digit(next(seed))})
                    except grpc.aio.AioRpcError as exc:
                        self.failures.append(f"{exc.code().name}: {exc.details()}")
                    else:
                        self.ok += 1
                        self.nodes[answer.node_id] += 1

            await asyncio.gather(*(worker() for _ in range(self.concurrency)))


async def until(condition, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Wait (bounded) for a condition the balancer reports."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_sigkill_a_server_under_load_loses_no_call_and_it_comes_back(
    tmp_path: Path,
) -> None:
    """The killed server comes back as an orchestrator brings one back: a new process on a
    port of its own (port 0: no other process can hold it), written into the backends file
    in place of the dead one's."""
    listing = tmp_path / "backends"
    with ExitStack() as stack:
        cluster = start_cluster(
            stack,
            3,
            *("--breaker-failures", "2", "--breaker-cooldown-s", "0.2"),
            *("--breaker-max-cooldown-s", "1"),
            listing=listing,
        )
        victim, *survivors = cluster.servers
        load = Load(cluster.balancer.address)
        running_load = asyncio.create_task(load.run())
        await until(lambda: load.ok > 200, "load to flow")
        victim.kill()  # SIGKILL
        await until(lambda: cluster.backend(victim.address).health == "NOT_SERVING", "drain")
        # Out of routing now. Its breaker opens only if two calls failed on it before the
        # health watch saw it go: which comes first is a race, so the test waits for neither
        # the breaker nor a count, only for its last calls to end.
        await until(lambda: cluster.backend(victim.address).in_flight == 0, "its calls to end")
        calls_while_down = cluster.backend(victim.address).calls
        served_before = load.ok
        await until(lambda: load.ok > served_before + 300, "traffic on the survivors")
        assert cluster.backend(victim.address).calls == calls_while_down  # it got no calls
        revived = stack.enter_context(running(server_argv(node_id="server-0-again")))
        addresses = [revived.address, *(s.address for s in survivors)]
        write_listing(listing, addresses, f"server-0 is back on {revived.address}")

        def revived_takes_traffic() -> bool:
            backends = {b.address: b for b in cluster.health().backends}
            b = backends.get(revived.address)
            return (
                sorted(backends) == sorted(addresses)  # and the dead address is gone
                and b is not None
                and b.health == "SERVING"
                and b.breaker == "CLOSED"
                and b.calls > 20
            )

        await until(revived_takes_traffic, "the revived server to take traffic")
        load.stop.set()
        await running_load
        assert load.nodes["server-0-again"] > 0
        assert load.failures == []


async def test_sigterm_a_server_under_load_drains_with_no_failed_call() -> None:
    with ExitStack() as stack:
        # A grace period far beyond the 60 s this test waits for the exit: a server that
        # waited out its grace for the balancer's open streams would fail the test.
        cluster = start_cluster(stack, 3, server_extra=("--grace-s", "600"))
        leaving = cluster.servers[1]
        load = Load(cluster.balancer.address)
        running_load = asyncio.create_task(load.run())
        await until(lambda: load.ok > 200, "load to flow")
        exit_code = await asyncio.to_thread(leaving.terminate, 60)
        assert exit_code == 0, leaving.log()
        served = load.ok
        await until(lambda: load.ok > served + 300, "traffic on the others")
        load.stop.set()
        await running_load
        assert load.failures == []
        assert cluster.backend(leaving.address).health == "NOT_SERVING"


def test_no_backend_is_unavailable_with_a_reason(tmp_path: Path) -> None:
    with (
        running(balancer_argv("127.0.0.1:1"), serving=False) as balancer,  # nothing on port 1
        SluiceClient(balancer.address) as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.predict({"input": digit(1)}, timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1:1" in caught.value.details()


def test_backends_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    with ExitStack() as stack:
        servers = [stack.enter_context(running(server_argv(node_id=f"f{i}"))) for i in range(2)]
        listing = tmp_path / "backends"
        write_listing(listing, [servers[0].address], "one for now")
        balancer = stack.enter_context(
            running(
                [
                    *(str(BIN / "sluice-balancer"), "--port", "0"),
                    *("--backends-file", str(listing), "--refresh-s", "0.1"),
                ]
            )
        )
        with SluiceClient(balancer.address) as client:
            assert [b.address for b in client.health().backends] == [servers[0].address]
            both = sorted(s.address for s in servers)
            write_listing(listing, both, "grown")
            wait_for(
                lambda: sorted(b.address for b in client.health().backends) == both,
                "the file change to apply",
            )
            nodes = {client.infer({"input": digit(i)}).node_id for i in range(40)}
        assert nodes == {"f0", "f1"}


def test_the_client_balances_by_itself_with_the_same_policies(cluster: Cluster) -> None:
    """Proxyless: the client routes over the servers itself. A dead address costs no call."""
    targets = [s.address for s in cluster.servers] + ["127.0.0.1:1"]
    with SluiceClient(targets) as client:
        owners = {}
        for round_ in range(3):
            for i in range(20):
                node = client.infer({"input": digit(5000 + i)}).node_id
                assert owners.setdefault(i, node) == node, (round_, i)
        assert len(set(owners.values())) == 3
        dead = client._router.pool.backends["127.0.0.1:1"]  # type: ignore[union-attr]
        assert dead.failures >= 1  # it was tried, failed, and each call went elsewhere


async def test_the_async_client_balances_too(cluster: Cluster) -> None:
    async with AsyncSluiceClient([s.address for s in cluster.servers]) as client:
        answers = await asyncio.gather(
            *(client.infer({"input": digit(7000 + i)}, no_cache=True) for i in range(60))
        )
    assert len({a.node_id for a in answers}) == 3  # least-loaded spreads uncached calls


def test_workers_share_one_port_and_stop_together(cluster: Cluster) -> None:
    argv = balancer_argv(cluster.servers[0].address, extra=("--workers", "2"))
    with running(argv) as balancer:
        # The worker logs on the stderr it inherits from the first process.
        listening = f"listening on {balancer.address}"
        wait_for(
            lambda: sum(listening in line for line in list(balancer.lines)) == 2,
            "the worker to listen on the same port",
        )
        (worker,) = children(balancer.pid)
        try:
            with SluiceClient(balancer.address) as client:
                for i in range(20):
                    assert client.predict({"input": digit(9000 + i)})["label"].shape == (1,)
            balancer.proc.send_signal(signal.SIGTERM)
            assert balancer.proc.wait(60) == 0, balancer.log()
            # The first process waited for its worker: both are gone, and nothing answers.
            assert not Path(f"/proc/{worker}").exists()
            with SluiceClient(balancer.address) as client, pytest.raises(grpc.RpcError):
                client.health(timeout=5)
        except BaseException:
            stop_stray_worker(worker)  # it holds the stderr pipe: closing it would hang
            raise


def stop_stray_worker(pid: int) -> None:
    """SIGKILL `pid` if it is still a balancer worker (and not a process that took its pid)."""
    with contextlib.suppress(OSError):
        if b"sluice.balancer.main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("via", ["server", "balancer"])
def test_garbage_on_a_stream_ends_it_with_invalid_argument(cluster: Cluster, via: str) -> None:
    address = cluster.servers[0].address if via == "server" else cluster.balancer.address
    good = pb.StreamRequest(
        id=7, request=pb.PredictRequest(inputs=HOSTILE["wrong dimension"][0]).SerializeToString()
    ).SerializeToString()
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream("/sluice.v1.Inference/PredictStream")
        replies = [
            pb.StreamResponse.FromString(r)
            for r in call(iter([good, b"\xff\xff\xff\xff"]), timeout=10)
        ]
    by_id = {r.id: r for r in replies}
    assert by_id[7].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # answered, not lost
    assert by_id[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "not a valid sluice.v1.StreamRequest" in by_id[0].message
    with SluiceClient(address) as client:  # and the node still serves
        assert client.predict({"input": digit(1)})["label"].shape == (1,)
