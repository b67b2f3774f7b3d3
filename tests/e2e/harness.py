"""The end-to-end harness: real Sluice processes on port 0 (sluice.runtime.launch), with the
CPU forced so the tests behave alike on any machine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sluice.client import SluiceClient
from sluice.runtime.launch import BIN, Process, module_argv, running
from sluice.runtime.launch import server_argv as _server_argv

__all__ = [
    "BIN",
    "Process",
    "module_argv",
    "running",
    "running_server",
    "server_argv",
    "wait_arrived",
]


def server_argv(*extra: str, node_id: str = "test-node", model: Path | None = None) -> list[str]:
    return _server_argv("--device", "cpu", *extra, node_id=node_id, model=model)


@contextmanager
def running_server(*extra: str, node_id: str = "test-node") -> Iterator[Process]:
    with running(server_argv(*extra, node_id=node_id)) as proc:
        yield proc


def wait_arrived(address: str, count: int, timeout: float = 30.0) -> int:
    """Until the server reports `count` Predict calls begun (bounded); returns how many are in
    flight then. Health goes over its own connection so it does not queue behind big requests."""
    deadline = time.monotonic() + timeout
    with SluiceClient(address, options=[("grpc.use_local_subchannel_pool", 1)]) as watcher:
        while (health := watcher.health()).requests < count:
            assert time.monotonic() < deadline, "calls never arrived at the server"
            time.sleep(0.005)
    return health.in_flight
