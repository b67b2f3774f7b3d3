"""`sluice up`, the README's first command: servers behind a balancer, stopped by Ctrl-C."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest

from sluice.client import SluiceClient
from tests.e2e.harness import BIN

pytestmark = pytest.mark.e2e


def test_sluice_up_serves_through_the_balancer_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    # From a directory that is not the repository: the bundled model comes with the package.
    proc = subprocess.Popen(
        [str(BIN / "sluice"), "up", "--servers", "2", "--port", "0"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once every process is SERVING
        found = re.search(r"balancer on (\S+) -> servers on (\S+), (\S+) ", line)
        assert found, line
        balancer, *servers = found.groups()
        rng = np.random.default_rng(3)
        with SluiceClient(balancer) as client:
            nodes = {
                client.infer({"input": rng.uniform(0, 16, (1, 64)).astype(np.float32)}).node_id
                for _ in range(30)
            }
            assert [b.address for b in client.health().backends] == servers
        assert nodes == {"server-1", "server-2"}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for address in [balancer, *servers]:  # everything it started is gone
            with SluiceClient(address) as client, pytest.raises(grpc.RpcError):
                client.health(timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
