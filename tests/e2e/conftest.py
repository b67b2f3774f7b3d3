"""The end-to-end tier: real processes on 127.0.0.1, started on port 0."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from perf.make_mlp import build
from tests.e2e.harness import Cluster, Process, running_server, start_cluster


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with running_server("--max-message-bytes", str(1024 * 1024)) as proc:
        yield proc


@pytest.fixture(scope="session")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1024-wide MLP: heavy enough (~0.15 ms a row here) that requests queue behind a
    running batch, and one long call holds an instance for seconds."""
    path = tmp_path_factory.mktemp("models") / "mlp1024.onnx"
    path.write_bytes(build(width=1024, depth=2))
    return path


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The module's SERVERS servers (3 unless it says) behind one balancer."""
    with ExitStack() as stack:
        yield start_cluster(stack, getattr(request.module, "SERVERS", 3))
