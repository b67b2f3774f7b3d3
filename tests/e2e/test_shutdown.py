"""SIGTERM and SIGINT on a busy server: every in-flight call completes, the exit is clean."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from sluice.client import SluiceClient
from tests.e2e.harness import Process, running_server, server_argv, wait_arrived

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


def test_refuses_to_share_a_taken_port() -> None:
    with running_server() as first:
        port = first.address.rsplit(":", 1)[1]
        with pytest.raises(RuntimeError, match="cannot listen on 127.0.0.1:" + port):
            Process(server_argv("--port", port))
        first.wait_serving()
