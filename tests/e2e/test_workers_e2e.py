"""`sluice-balancer --workers N` under supervision: a killed worker is respawned while the port
keeps answering, workers do not outlive the first process, and a second balancer cannot join
a port another one holds."""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import AbstractContextManager, ExitStack

import pytest

from sluice.client import SluiceClient
from tests.e2e.harness import (
    Process,
    alive,
    balancer_argv,
    children,
    listening,
    running,
    wait_for,
    with_workers,
    workers,
)
from tests.e2e.test_balancer_e2e import digit

pytestmark = pytest.mark.e2e

WORKER = b"sluice.balancer.main"


def balancer_with_workers(backend: str, count: int) -> AbstractContextManager[Process]:
    return with_workers(balancer_argv(backend, extra=("--workers", str(count))), count, WORKER)


def test_a_killed_worker_is_respawned_and_the_port_keeps_answering(server: Process) -> None:
    with balancer_with_workers(server.address, 3) as balancer, ExitStack() as stack:
        # Connections of their own, so that they spread over the processes.
        clients = [
            stack.enter_context(
                SluiceClient(balancer.address, options=[("grpc.use_local_subchannel_pool", 1)])
            )
            for _ in range(4)
        ]
        calls = failures = 0

        def call() -> None:
            nonlocal calls, failures
            client = clients[calls % len(clients)]
            calls += 1
            try:
                assert client.predict({"input": digit(calls)})["label"].shape == (1,)
            except Exception:
                failures += 1

        for _ in range(8):
            call()
        assert failures == 0, balancer.log()
        before = workers(balancer, 2)
        os.kill(before[0], signal.SIGKILL)

        def respawned() -> list[int] | None:
            call()  # calls go on all along
            now = sorted(pid for pid in children(balancer.pid) if alive(pid))
            fresh = len(now) == 2 and before[0] not in now and listening(balancer) == 4
            return now if fresh else None

        after = wait_for(respawned, "a new worker to listen")
        assert before[1] in after
        for _ in range(20):
            call()
        # At most the call in flight on each connection the dead worker held.
        assert failures <= len(clients), balancer.log()
        assert "exited unexpectedly" in balancer.log()
        assert balancer.proc.poll() is None


def test_workers_exit_when_the_first_process_is_killed(server: Process) -> None:
    with balancer_with_workers(server.address, 3) as balancer:
        pids = workers(balancer, 2)
        port = balancer.address.rpartition(":")[2]
        balancer.proc.kill()
        balancer.proc.wait()
        # The bound guards against a hang only: they notice at once and drain nothing.
        wait_for(lambda: not any(alive(pid) for pid in pids), "the workers to exit", 10.0)
        # The port is free again: a replacement binds it.
        argv = balancer_argv(server.address, extra=("--workers", "2", "--port", port))
        with running(argv) as replacement:
            assert replacement.address == balancer.address
            wait_for(lambda: listening(replacement) == 2, "the replacement's worker to listen")
            (worker,) = workers(replacement, 1)
            assert replacement.terminate() == 0, replacement.log()
            assert not alive(worker)


@pytest.mark.parametrize("count", [1, 2])
def test_a_second_balancer_on_a_taken_port_fails_loudly(server: Process, count: int) -> None:
    with balancer_with_workers(server.address, 2) as first:
        port = first.address.rpartition(":")[2]
        argv = balancer_argv(server.address, extra=("--workers", str(count), "--port", port))
        second = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
        )
        assert second.returncode != 0
        assert f":{port}" in second.stderr and "cannot listen" in second.stderr, second.stderr
        assert "listening on" not in second.stderr
        with SluiceClient(first.address) as client:  # the first one is untouched
            assert client.predict({"input": digit(3)})["label"].shape == (1,)
