"""`--default-timeout-s`: a call that carries no deadline gets one, on server and balancer;
a call with its own deadline keeps it."""

from __future__ import annotations

from contextlib import ExitStack

import grpc
import pytest

from sluice.client import SluiceClient
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, running, server_argv

pytestmark = pytest.mark.e2e

TINY = "0.000001"  # passes before any call can reach the model


def test_calls_without_a_deadline_get_the_default_one() -> None:
    with ExitStack() as stack:
        plain = stack.enter_context(running(server_argv(node_id="plain")))
        strict = stack.enter_context(
            running(server_argv("--default-timeout-s", TINY, node_id="strict"))
        )
        balancer = stack.enter_context(
            running(
                [
                    *(str(BIN / "sluice-balancer"), "--port", "0", "--backend", plain.address),
                    *("--default-timeout-s", TINY),
                ]
            )
        )
        for address in (strict.address, balancer.address):
            with SluiceClient(address, timeout=None) as client:
                with pytest.raises(grpc.RpcError) as caught:
                    client.predict({"input": SAMPLES[1].input}, no_cache=True)
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, address
                assert "deadline passed" in caught.value.details()
                # A deadline of the caller's own is kept.
                answer = client.predict({"input": SAMPLES[1].input}, timeout=10, no_cache=True)
                assert answer["label"].tolist() == [1]
        with SluiceClient(plain.address, timeout=None) as client:  # no default: no deadline
            assert client.predict({"input": SAMPLES[1].input})["label"].tolist() == [1]
