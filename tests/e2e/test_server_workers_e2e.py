"""`sluice-server --workers N`: N processes serve one port, each with its own models; a
killed worker is respawned while the port keeps answering; SIGTERM stops them all."""

from __future__ import annotations

import os
import signal
from contextlib import AbstractContextManager

import pytest

from sluice import models
from sluice.client import SluiceClient
from tests.e2e.harness import (
    Process,
    alive,
    listening,
    server_argv,
    wait_for,
    with_workers,
    workers,
)

pytestmark = pytest.mark.e2e

WORKER = b"sluice.server.main"


def server_with_workers(count: int) -> AbstractContextManager[Process]:
    return with_workers(server_argv("--workers", str(count), node_id="w"), count, WORKER)


def test_workers_share_the_port_are_respawned_and_stop_with_the_first() -> None:
    x = models.samples()[3].input
    with server_with_workers(2) as server:
        for _ in range(8):  # connections of their own, spread over the processes
            with SluiceClient(server.address, options=[("grpc.use_local_subchannel_pool", 1)]) as c:
                assert c.predict({"input": x})["label"][0] == 3
        (worker,) = workers(server, 1)
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: listening(server) == 3, "the respawned worker to listen")
        (fresh,) = workers(server, 1)
        assert fresh != worker and "exited unexpectedly" in server.log()
        with SluiceClient(server.address) as client:
            assert client.predict({"input": x})["label"][0] == 3
        assert server.terminate() == 0, server.log()
        assert not alive(fresh)
