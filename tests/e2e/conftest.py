"""The end-to-end tier: real processes on 127.0.0.1, started on port 0."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import Process, running_server


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with running_server("--max-message-bytes", str(1024 * 1024)) as proc:
        yield proc
