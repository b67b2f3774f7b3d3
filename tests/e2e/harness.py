"""The end-to-end harness: real Sluice processes on port 0 (sluice.runtime.launch), with the
CPU forced so the tests behave alike on any machine. Waits poll something a process reports,
with a bound that only guards against a hang."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

from sluice.client import SluiceClient
from sluice.runtime.launch import BIN, Process, children, module_argv, running
from sluice.runtime.launch import server_argv as _server_argv
from sluice.v1 import inference_pb2 as pb

__all__ = [
    "BIN",
    "Process",
    "alive",
    "children",
    "kill_strays",
    "module_argv",
    "running",
    "running_server",
    "server_argv",
    "wait_arrived",
    "wait_for",
    "wait_health",
]

T = TypeVar("T")


def server_argv(*extra: str, node_id: str = "test-node", model: Path | None = None) -> list[str]:
    return _server_argv("--device", "cpu", *extra, node_id=node_id, model=model)


@contextmanager
def running_server(*extra: str, node_id: str = "test-node") -> Iterator[Process]:
    with running(server_argv(*extra, node_id=node_id)) as proc:
        yield proc


def wait_for(probe: Callable[[], T | None], what: str, timeout: float = 30.0) -> T:
    """Poll `probe` until it returns something other than None or False (bounded)."""
    deadline = time.monotonic() + timeout
    while (found := probe()) is None or found is False:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
    return found


def wait_health(
    address: str,
    condition: Callable[[pb.HealthResponse], bool],
    what: str,
    timeout: float = 30.0,
) -> pb.HealthResponse:
    """The first Health report of the process at `address` that meets `condition` (bounded).
    Health goes over its own connection so it does not queue behind big requests."""
    with SluiceClient(address, options=[("grpc.use_local_subchannel_pool", 1)]) as watcher:

        def probe() -> pb.HealthResponse | None:
            health = watcher.health()
            return health if condition(health) else None

        return wait_for(probe, what, timeout)


def wait_arrived(address: str, count: int, timeout: float = 30.0) -> int:
    """Until the server reports `count` Predict calls begun (bounded); returns how many are in
    flight then."""
    health = wait_health(
        address, lambda h: h.requests >= count, "calls to arrive at the server", timeout
    )
    return health.in_flight


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (Linux: a zombie, exited but not yet reaped, is not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z"


def kill_strays(pids: Iterable[int], marker: bytes) -> None:
    """SIGKILL each of `pids` still running a command line holding `marker` (and not some
    process that took its pid since)."""
    for pid in pids:
        with suppress(OSError):
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
