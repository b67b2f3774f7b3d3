"""Tenants on a real server: API keys from a file of digests, UNAUTHENTICATED without one,
a rate quota answered RESOURCE_EXHAUSTED with when to retry, per-tenant Health and metrics,
refusal reasons counted, the file re-read while serving."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.client import AsyncSluiceClient
from sluice.core.tenants import digest
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec
from tests.conftest import SAMPLES
from tests.e2e.harness import (
    BIN,
    NOT_INLINE,
    hold_the_instance,
    rows,
    running,
    server_argv,
    wait_for,
    wait_health,
)
from tests.e2e.test_metrics_e2e import free_port, get, scrape

pytestmark = pytest.mark.e2e

ALPHA, OPS, LATE = "sk-alpha-test-key", "sk-ops-test-key", "sk-late-test-key"
TENANTS = f"""
[tenants.alpha]
keys = ["{digest(ALPHA)}"]
rate = 1
burst = 3

[tenants.ops]
keys = ["{digest(OPS)}"]
admin = true
"""


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def body() -> bytes:
    return pb.PredictRequest(
        inputs=codec.encode_all({"input": SAMPLES[3].input})
    ).SerializeToString()


def test_keys_quota_health_metrics_and_reread(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    port = free_port()
    argv = server_argv("--tenants", str(path), "--metrics-port", str(port))
    with running(argv) as server, grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        predict = channel.unary_unary(
            "/sluice.v1.Inference/Predict", request_serializer=None, response_deserializer=None
        )
        for metadata, says in (((), "no API key"), (bearer("sk-wrong"), "not one this node")):
            with pytest.raises(grpc.RpcError) as refused:
                predict(body(), metadata=metadata, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert refused.value.details().startswith("unauthenticated: ")
            assert says in refused.value.details()
        # Probes need no key.
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert not stub.Health(pb.HealthRequest(), timeout=10).tenants

        # Its burst of 3, then the quota, with the time to wait.
        for _ in range(3):
            reply = pb.PredictResponse.FromString(predict(body(), metadata=bearer(ALPHA)))
            assert reply.outputs
        with pytest.raises(grpc.RpcError) as refused:
            predict(body(), metadata=bearer(ALPHA), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith("quota: tenant alpha is over its 1 calls/s")
        trailers = dict(refused.value.trailing_metadata() or ())
        assert 0 < int(trailers["retry-after-ms"]) <= 1000

        own = stub.Health(pb.HealthRequest(), metadata=bearer(ALPHA), timeout=10)
        assert [t.name for t in own.tenants] == ["alpha"]
        alpha = own.tenants[0]
        assert (alpha.ok, alpha.refused["quota"], alpha.rate, alpha.priority) == (
            3,
            1,
            1.0,
            "interactive",
        )
        every = stub.Health(pb.HealthRequest(), metadata=bearer(OPS), timeout=10)
        assert sorted(t.name for t in every.tenants) == ["alpha", "ops"]
        assert every.refusals["unauthenticated"] == 2 and every.refusals["quota"] == 1

        samples = scrape(port)
        assert get(samples, "sluice_refusals_total", reason="quota") == 1
        assert get(samples, "sluice_refusals_total", reason="unauthenticated") == 2
        assert get(samples, "sluice_tenant_calls_total", tenant="alpha", outcome="OK") == 3
        assert (
            get(samples, "sluice_tenant_calls_total", tenant="alpha", outcome="refused:quota") == 1
        )

        # A tenant added to the file is let in without a restart.
        path.write_text(TENANTS + f'\n[tenants.late]\nkeys = ["{digest(LATE)}"]\n')
        os.utime(path, ns=(1, 1))

        def admitted() -> bool | None:
            try:
                predict(body(), metadata=bearer(LATE), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                return None
            return True

        wait_for(admitted, "the new tenant's key accepted", timeout=20)


def test_a_key_made_by_sluice_key_lets_the_cli_in(tmp_path: Path) -> None:
    made = subprocess.run(
        [str(BIN / "sluice"), "key", "team", "--priority", "batch"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    key = made.splitlines()[1]
    path = tmp_path / "tenants.toml"
    path.write_text(made.partition("# for the tenants file:\n")[2])
    with running(server_argv("--tenants", str(path))) as server:
        predict = [str(BIN / "sluice"), "predict", "--sample", "3", "--target", server.address]
        refused = subprocess.run(predict, capture_output=True, text=True)
        assert refused.returncode == 1
        assert "UNAUTHENTICATED: unauthenticated: the call carries no API key" in refused.stderr
        answered = subprocess.run(
            [*predict, "--json-output"],
            capture_output=True,
            text=True,
            env={**os.environ, "SLUICE_API_KEY": key},
        )
        assert answered.returncode == 0, answered.stderr
        assert '"label"' in answered.stdout
        with grpc.insecure_channel(server.address) as channel:
            health = pb_grpc.InferenceStub(channel).Health(
                pb.HealthRequest(), metadata=bearer(key), timeout=10
            )
        assert [(t.name, t.priority, t.ok) for t in health.tenants] == [("team", "batch", 1)]


def test_the_balancer_checks_keys_and_quota_and_shows_backends_to_admins(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    with (
        running(server_argv("--tenants", str(path))) as server,
        running(
            [
                *(str(BIN / "sluice-balancer"), "--port", "0", "--backend", server.address),
                *("--tenants", str(path)),
            ]
        ) as balancer,
        grpc.insecure_channel(balancer.address) as channel,
    ):
        stub = pb_grpc.InferenceStub(channel)
        wait_for(
            lambda: (
                stub.Health(pb.HealthRequest(), metadata=bearer(OPS), timeout=10).status
                == "SERVING"
                or None
            ),
            "the balancer's backend SERVING",
        )
        predict = channel.unary_unary(
            "/sluice.v1.Inference/Predict", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as refused:
            predict(body(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The key goes on to the server, whose own door lets it in too.
        for _ in range(3):
            reply = predict(body(), metadata=bearer(ALPHA), timeout=10)
            assert pb.PredictResponse.FromString(reply).outputs
        with pytest.raises(grpc.RpcError) as refused:
            predict(body(), metadata=bearer(ALPHA), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith("quota: tenant alpha")
        assert "retry-after-ms" in dict(refused.value.trailing_metadata() or ())
        metadata = stub.Metadata(pb.MetadataRequest(), metadata=bearer(OPS), timeout=10)
        assert metadata.model.name
        with pytest.raises(grpc.RpcError) as refused:
            stub.Metadata(pb.MetadataRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        anyone = stub.Health(pb.HealthRequest(), timeout=10)
        tenant = stub.Health(pb.HealthRequest(), metadata=bearer(ALPHA), timeout=10)
        admin = stub.Health(pb.HealthRequest(), metadata=bearer(OPS), timeout=10)
        assert not anyone.backends and not tenant.backends and not anyone.tenants
        assert [b.address for b in admin.backends] == [server.address]
        assert [t.name for t in tenant.tenants] == ["alpha"]
        assert tenant.tenants[0].ok == 3 and tenant.tenants[0].refused["quota"] == 1
        assert sorted(t.name for t in admin.tenants) == ["alpha", "ops"]
        assert admin.refusals["unauthenticated"] == 2 and admin.refusals["quota"] == 1
        with pytest.raises(grpc.RpcError) as refused:
            stub.Health(pb.HealthRequest(), metadata=bearer("sk-wrong"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_an_interactive_call_runs_before_queued_batch_calls(
    tmp_path: Path, mlp: Path
) -> None:
    """One instance held by a long call; three batch-class calls queue, then one
    interactive call: the interactive call runs first when the instance frees up."""
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenants.app]\nkeys = ["{digest(ALPHA)}"]\n\n'
        f'[tenants.bulk]\nkeys = ["{digest(OPS)}"]\npriority = "batch"\n'
    )
    argv = server_argv(
        *("--tenants", str(path), "--instances", "1", "--max-batch", "1"),
        *("--cache-entries", "0", *NOT_INLINE),
        model=mlp,
    )
    with running(argv) as server:
        async with (
            AsyncSluiceClient(server.address, timeout=300, api_key=OPS) as bulk,
            AsyncSluiceClient(server.address, timeout=300, api_key=ALPHA) as app,
        ):
            holding = await hold_the_instance(bulk, server.address, blocker_rows=64_000, seed=7)
            finished: list[str] = []

            def call(client: AsyncSluiceClient, name: str, x: np.ndarray) -> asyncio.Task[Any]:
                task = asyncio.create_task(client.predict({"input": x}))
                task.add_done_callback(lambda _: finished.append(name))
                return task

            inputs = rows(4, seed=8)
            # Each batch call runs ~0.3 s, so the order in which the answers reach this
            # process is the order the server ran them in, however loaded the machine.
            queued = [call(bulk, f"bulk{i}", inputs[i].repeat(2_000, axis=0)) for i in range(3)]
            await asyncio.to_thread(
                wait_health, server.address, lambda h: h.batcher.queue_depth == 3, "3 queued"
            )
            urgent = call(app, "app", inputs[3])
            await asyncio.to_thread(
                wait_health, server.address, lambda h: h.batcher.queue_depth == 4, "4 queued"
            )
            await asyncio.gather(holding, urgent, *queued)
    # The three batch calls may reach the queue in any order; the interactive one is first.
    assert finished[0] == "app" and sorted(finished[1:]) == ["bulk0", "bulk1", "bulk2"]
