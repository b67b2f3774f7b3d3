"""SIGTERM and SIGINT on a busy server: every in-flight call completes, the exit is clean;
with --drain-delay-s, the server says NOT_SERVING for a while before it refuses calls."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.client import SluiceClient
from tests.conftest import SAMPLES
from tests.e2e.harness import Process, running_server, server_argv, wait_arrived, wait_for

pytestmark = pytest.mark.e2e

CALLS = 4
ROWS = 100_000  # about 0.3 s of model time per call here, one call at a time


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_in_flight_calls_then_exits_zero(
    sig: signal.Signals, reference: ort.InferenceSession
) -> None:
    rng = np.random.default_rng(0)
    batches = [rng.uniform(0, 16, (ROWS, 64)).astype(np.float32) for _ in range(CALLS)]
    with running_server("--instances", "1", "--grace-s", "60") as server:
        client = SluiceClient(server.address, timeout=60)
        with ThreadPoolExecutor(CALLS) as pool:
            futures = [pool.submit(client.predict, {"input": b}) for b in batches]
            in_flight = wait_arrived(server.address, CALLS)
            server.proc.send_signal(sig)
            results = [f.result(timeout=60) for f in futures]
        assert server.proc.wait(60) == 0, server.log()
        server.close()
        # The server is gone: new calls fail fast rather than hang.
        with pytest.raises(grpc.RpcError):
            client.predict({"input": batches[0][:1]}, timeout=2)
        client.close()
    assert in_flight >= 2, "too few calls were in flight to test the drain"
    for batch, result in zip(batches, results, strict=True):
        np.testing.assert_array_equal(
            result["label"], reference.run(["label"], {"input": batch})[0]
        )
    assert "stopped after" in server.log()


def test_while_draining_new_calls_are_refused_retryable_and_in_flight_ones_answered(
    reference: ort.InferenceSession,
) -> None:
    """Past the signal the server keeps its connections (grpc would close each as its last
    call ends, resetting a caller still reading that reply): a new call gets the draining
    refusal, with the trailer that lets a balancer or client retry it elsewhere."""
    rng = np.random.default_rng(1)
    batches = [rng.uniform(0, 16, (ROWS, 64)).astype(np.float32) for _ in range(CALLS)]
    x = SAMPLES[0].input
    refusals: list[grpc.RpcError] = []
    with running_server("--instances", "1", "--grace-s", "60") as server:
        client = SluiceClient(server.address, timeout=60)
        client.predict({"input": x})  # the connection is up before the signal
        with ThreadPoolExecutor(CALLS) as pool:
            futures = [pool.submit(client.predict, {"input": b}) for b in batches]
            wait_arrived(server.address, CALLS + 1)
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            # Until the signal is seen: calls before it are answered, those after refused.
            while not refusals and not all(f.done() for f in futures):
                assert time.monotonic() < deadline, "no call was refused while draining"
                try:
                    client.predict({"input": x}, no_cache=True, timeout=10)
                except grpc.RpcError as exc:
                    refusals.append(exc)
            results = [f.result(timeout=60) for f in futures]
        assert server.proc.wait(60) == 0, server.log()
        server.close()
        client.close()
    assert refusals, "the calls in flight ended before the drain refused one"
    refused = refusals[0]
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    assert "is draining: another node may take the call" in (refused.details() or "")
    assert ("x-refused", "draining") in tuple(refused.trailing_metadata() or ())  # type: ignore[attr-defined]
    for batch, result in zip(batches, results, strict=True):
        np.testing.assert_array_equal(
            result["label"], reference.run(["label"], {"input": batch})[0]
        )


def test_refuses_to_share_a_taken_port() -> None:
    with running_server() as first:
        port = first.address.rsplit(":", 1)[1]
        with pytest.raises(RuntimeError, match="cannot listen on 127.0.0.1:" + port):
            Process(server_argv("--port", port))
        first.wait_serving()


# Long next to the few calls made in it, even on a loaded machine.
DRAIN_DELAY_S = 3.0


def test_drain_delay_says_not_serving_while_still_answering_then_exits_zero(
    reference: ort.InferenceSession,
) -> None:
    x = SAMPLES[0].input
    with running_server("--drain-delay-s", str(DRAIN_DELAY_S)) as server:
        with (
            grpc.insecure_channel(server.address) as channel,
            SluiceClient(server.address) as client,
        ):
            check = health_pb2_grpc.HealthStub(channel).Check
            client.predict({"input": x})  # both connections are up before the signal
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            wait_for(
                lambda: (
                    check(health_pb2.HealthCheckRequest(), timeout=10).status
                    == health_pb2.HealthCheckResponse.NOT_SERVING
                ),
                "grpc.health.v1 to say NOT_SERVING",
            )
            # Told NOT_SERVING, and still answering: after the delay it refuses new calls.
            answer = client.predict({"input": x}, no_cache=True)
            assert client.health().status == "NOT_SERVING"
        assert server.proc.wait(60) == 0, server.log()
        stopped = time.monotonic()
        server.close()
    assert stopped - signalled >= DRAIN_DELAY_S  # it waited out the delay before stopping
    np.testing.assert_array_equal(answer["label"], reference.run(["label"], {"input": x})[0])
