"""Real processes for end-to-end tests, on top of perf.processes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from perf.processes import BIN, MODEL, ROOT, Process, running
from perf.processes import server_argv as _server_argv

__all__ = ["BIN", "MODEL", "ROOT", "Process", "running_server", "server_argv"]


def server_argv(*extra: str, node_id: str = "test-node") -> list[str]:
    return _server_argv("--device", "cpu", *extra, node_id=node_id)


@contextmanager
def running_server(*extra: str, node_id: str = "test-node") -> Iterator[Process]:
    with running(server_argv(*extra, node_id=node_id)) as proc:
        yield proc
