"""`--metrics-port` on real processes: two servers behind a balancer, each scraped over HTTP
at /metrics and parsed with Prometheus' text parser while calls, cache hits, refusals and a
backend's death (its breaker opens) happen; calls refused at the door; `--workers` gives each
balancer process its own port; JSON logs; the refusal log's line."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from tests.conftest import SAMPLES
from tests.e2e.harness import (
    NOT_INLINE,
    Process,
    balancer_argv,
    hold_the_instance,
    rows,
    running,
    server_argv,
    wait_for,
)

pytestmark = pytest.mark.e2e

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port(run: int = 1) -> int:
    """A port free now with the `run - 1` after it free too (bound, then let go)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        if port + run - 1 <= 65535 and all(_free(port + i) for i in range(1, run)):
            return port
    raise AssertionError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over every series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.fixture(scope="module")
def metered() -> Iterator[tuple[list[tuple[Process, int]], Process, int]]:
    """Two servers and a balancer, each with its metrics port; JSON logs on one server and
    on the balancer. One backend failure opens a breaker (two backends: the ejection cap
    lets one open), so a backend's death shows on its breaker deterministically."""
    with ExitStack() as stack:
        servers = []
        for i, extra in enumerate((("--log-format", "json"), ())):
            port = free_port()
            argv = server_argv("--metrics-port", str(port), *extra, node_id=f"server-{i}")
            servers.append((stack.enter_context(running(argv)), port))
        port = free_port()
        balancer = stack.enter_context(
            running(
                balancer_argv(
                    *(s.address for s, _ in servers),
                    extra=(
                        *("--metrics-port", str(port), "--log-format", "json"),
                        *("--breaker-failures", "1"),
                    ),
                )
            )
        )
        yield servers, balancer, port


def test_counters_and_histograms_move_with_calls(
    metered: tuple[list[tuple[Process, int]], Process, int],
) -> None:
    servers, balancer, balancer_port = metered
    addresses = [s.address for s, _ in servers]
    wait_for(  # the balancer has heard from both servers
        lambda: all(
            get(scrape(balancer_port), "sluice_backend_healthy", backend=a) == 1 for a in addresses
        ),
        "both backends SERVING in the balancer's metrics",
    )
    before = [scrape(port) for _, port in servers]
    with SluiceClient(balancer.address) as client:
        client.predict({"input": SAMPLES[0].input})  # a miss, then a hit: the same server
        answer = client.infer({"input": SAMPLES[0].input})
        assert answer.metadata.get("x-cache") == "hit"
        with pytest.raises(grpc.RpcError) as caught:
            client.predict({"input": np.zeros((1, 3), np.float32)})
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = [scrape(port) for _, port in servers]

    def moved(name: str, **labels: str) -> float:
        return sum(
            total(a, name, **labels) - total(b, name, **labels)
            for a, b in zip(after, before, strict=True)
        )

    assert moved("sluice_calls_total", method="Predict", code="OK") == 2
    assert moved("sluice_calls_total", method="Predict", code="INVALID_ARGUMENT") == 1
    assert moved("sluice_call_seconds_count", method="Predict") == 3
    assert moved("sluice_cache_hits_total") == 1
    assert moved("sluice_cache_misses_total") >= 1
    assert moved("sluice_queue_wait_seconds_count") == 1  # only the miss reached the model
    assert moved("sluice_model_seconds_count") == 1
    assert moved("sluice_batch_rows_sum") == 1
    assert moved("sluice_cache_entries") == 1
    assert moved("sluice_cache_bytes") > 0
    for samples in after:
        assert get(samples, "sluice_in_flight") == 0
        assert get(samples, "sluice_queue_depth") == 0
        assert ("sluice_admission_refused_total", frozenset()) in samples
        assert ("sluice_expired_total", frozenset()) in samples
        assert ("sluice_cache_evictions_total", frozenset()) in samples
        assert get(samples, "process_resident_memory_bytes") > 0

    routed = scrape(balancer_port)
    assert get(routed, "sluice_calls_total", method="Predict", code="OK") == 2
    assert get(routed, "sluice_calls_total", method="Predict", code="INVALID_ARGUMENT") == 1
    assert get(routed, "sluice_call_seconds_count", method="Predict") == 3
    assert get(routed, "sluice_in_flight") == 0
    assert total(routed, "sluice_backend_calls_total") == 3
    for address in addresses:
        assert get(routed, "sluice_backend_breaker_open", backend=address) == 0
        assert get(routed, "sluice_backend_in_flight", backend=address) == 0
        assert get(routed, "sluice_backend_failures_total", backend=address) == 0
        assert get(routed, "sluice_backend_limit", backend=address) == 0
        assert ("sluice_backend_ewma_seconds", frozenset({("backend", address)})) in routed
    for name in ("retries", "retry_budget_refused", "shed", "unavailable", "ejections"):
        assert get(routed, f"sluice_{name}_total") == 0


def test_json_logs_keep_the_lines_people_and_launchers_read(
    metered: tuple[list[tuple[Process, int]], Process, int],
) -> None:
    servers, balancer, _ = metered
    for proc in (servers[0][0], balancer):
        lines = [json.loads(line) for line in proc.lines if line.startswith("{")]
        assert lines and len(lines) == len(proc.lines), proc.log()
        assert {"time", "level", "logger", "message"} <= set(lines[0])
        messages = [line["message"] for line in lines]
        assert any(f"listening on {proc.address}" in m for m in messages)
        assert any(m.startswith("metrics at http://127.0.0.1:") for m in messages)
    assert any("is SERVING" in json.loads(line)["message"] for line in balancer.lines)
    assert not servers[1][0].lines[0].startswith("{")  # text by default


def test_a_dead_backend_shows_as_unhealthy_with_its_breaker_open(
    metered: tuple[list[tuple[Process, int]], Process, int],
) -> None:
    servers, balancer, balancer_port = metered
    survivor, victim = servers[0][0], servers[1][0]
    assert get(scrape(balancer_port), "sluice_backend_breaker_open", backend=victim.address) == 0
    with SluiceClient(balancer.address) as client:
        for sample in SAMPLES[:3]:  # calls before, then after the kill
            client.predict({"input": sample.input})
        victim.kill()
        wait_for(
            lambda: (
                get(scrape(balancer_port), "sluice_backend_healthy", backend=victim.address) == 0
            ),
            "the dead backend's sluice_backend_healthy to drop to 0",
        )
        # Its health watch broke: a backend failure, which opens its breaker (--breaker-
        # failures 1). Dead, it takes no probe, so the breaker stays OPEN or HALF_OPEN.
        wait_for(
            lambda: (
                get(scrape(balancer_port), "sluice_backend_breaker_open", backend=victim.address)
                == 1
            ),
            "the dead backend's sluice_backend_breaker_open to go to 1",
        )
        for sample in SAMPLES[:3]:  # the survivor answers every one
            client.predict({"input": sample.input})
    routed = scrape(balancer_port)
    assert get(routed, "sluice_backend_failures_total", backend=victim.address) >= 1
    assert get(routed, "sluice_backend_breaker_open", backend=survivor.address) == 0
    assert get(routed, "sluice_backend_healthy", backend=survivor.address) == 1


def test_each_balancer_worker_is_its_own_target() -> None:
    port = free_port(run=2)
    with ExitStack() as stack:
        server = stack.enter_context(running(server_argv(node_id="solo")))
        balancer = stack.enter_context(
            running(
                balancer_argv(server.address, extra=("--workers", "2", "--metrics-port", str(port)))
            )
        )
        for target in (port, port + 1):  # the first process, then its worker
            wait_for(
                lambda target=target: _answers(target),
                f"metrics of the process on port {target}",
            )
        with SluiceClient(balancer.address) as client:
            for sample in SAMPLES:
                client.predict({"input": sample.input})
        calls = sum(total(scrape(p), "sluice_calls_total", code="OK") for p in (port, port + 1))
        assert calls == len(SAMPLES)


def _answers(port: int) -> bool:
    try:
        return ("sluice_in_flight", frozenset()) in scrape(port)
    except OSError:
        return False


async def test_a_call_refused_at_the_door_is_counted_and_logged(mlp: Path) -> None:
    """The recipe of test_server_speed_e2e's refusal at the door: once the server has
    measured runs of two sizes, a call with a 0.5 s deadline behind seconds of work is
    refused at once. sluice_admission_refused_total and the RESOURCE_EXHAUSTED calls move
    by one, and within the refusal log's interval (10 s) one WARNING line sums it up."""
    small = pb.PredictRequest(inputs=[codec.encode("input", rows(1, seed=20)[0])])
    port = free_port()
    argv = server_argv(
        *("--metrics-port", str(port), "--instances", "1", "--max-batch", "1"),
        *("--cache-entries", "0", *NOT_INLINE),
        model=mlp,
    )
    with running(argv) as server:
        async with (
            AsyncSluiceClient(server.address, timeout=300) as client,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            before = await asyncio.to_thread(scrape, port)
            running_call = await hold_the_instance(
                client, server.address, blocker_rows=64_000, seed=18
            )
            predict = channel.unary_unary(
                "/sluice.v1.Inference/Predict",
                request_serializer=None,
                response_deserializer=None,
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await predict(small.SerializeToString(), timeout=0.5)
            after = await asyncio.to_thread(scrape, port)
            await running_call
            line = await asyncio.to_thread(
                wait_for,
                lambda: next((m for m in server.lines if " calls in the last " in m), None),
                "the refusal log's line",
            )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert get(before, "sluice_admission_refused_total") == 0
    assert get(after, "sluice_admission_refused_total") == 1
    assert get(after, "sluice_calls_total", method="Predict", code="RESOURCE_EXHAUSTED") == 1
    assert "WARNING" in line and "RESOURCE_EXHAUSTED 1" in line, line
    assert "refused 1 of " in line, line
