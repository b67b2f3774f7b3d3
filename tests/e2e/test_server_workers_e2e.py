"""`sluice-server --workers N`: N processes serve one port, each with its own models; a
killed worker is respawned while the port keeps answering; SIGTERM stops them all."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from sluice import models
from sluice.client import SluiceClient
from tests.e2e.harness import Process, alive, children, kill_strays, running, server_argv, wait_for

pytestmark = pytest.mark.e2e

WORKER = b"sluice.server.main"
LISTENING = "listening on "


def listening(server: Process) -> int:
    """How many processes announced the port (the workers share the first one's stderr)."""
    return sum(f"{LISTENING}{server.address}" in line for line in list(server.lines))


def workers(server: Process, count: int) -> list[int]:
    def probe() -> list[int] | None:
        found = sorted(pid for pid in children(server.pid) if alive(pid))
        return found if len(found) == count else None

    return wait_for(probe, f"{count} workers")


@contextmanager
def server_with_workers(count: int) -> Iterator[Process]:
    seen: set[int] = set()
    with running(server_argv("--workers", str(count), node_id="w")) as server:
        try:
            wait_for(lambda: listening(server) == count, "every worker to listen")
            seen.update(workers(server, count - 1))
            yield server
        finally:
            seen.update(children(server.pid))
    kill_strays(seen, WORKER)


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
