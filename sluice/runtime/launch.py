"""Start Sluice processes (servers, balancers, the perf floors) on port 0, for benchmarks and
the end-to-end tests: the bound address is read back from the "listening on HOST:PORT" log
line, readiness is the gRPC health check, and every process is stopped by its pid."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

BIN = Path(sys.executable).parent
LISTENING = re.compile(r"listening on ([\d.]+):(\d+)")


class Process:
    """A started Sluice process; its stderr is kept in `lines` for failure messages."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.address = self._wait_for_address(timeout=30.0)
        self._drain = threading.Thread(target=self._keep_reading, daemon=True)
        self._drain.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_for_address(self, timeout: float) -> str:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stderr, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if not sel.select(left):
                    break
                line = self.proc.stderr.readline()
                if not line:
                    break
                self.lines.append(line)
                found = LISTENING.search(line)
                if found:
                    return f"{found[1]}:{found[2]}"
        self.kill()
        raise RuntimeError(
            f"{' '.join(self.argv)} did not start (exit status {self.proc.returncode}):\n"
            + self.log()
        )

    def _keep_reading(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout: float = 30.0, *, require: bool = True) -> None:
        with grpc.insecure_channel(self.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=timeout)
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True
            )
            if require:
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.close()

    def close(self) -> None:
        """Collect the rest of stderr once the process has exited."""
        drain = getattr(self, "_drain", None)
        if drain is not None:
            drain.join(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def server_argv(*extra: str, node_id: str = "node", model: Path | None = None) -> list[str]:
    """`sluice-server` on a free port; the bundled model unless `model` is given."""
    chosen = ["--model", str(model)] if model is not None else []
    return [str(BIN / "sluice-server"), *chosen, "--port", "0", "--node-id", node_id, *extra]


@contextmanager
def running(argv: Sequence[str], *, serving: bool = True) -> Iterator[Process]:
    """A process for the length of the block, from the moment its health check says SERVING
    (or, with `serving=False`, from the moment it answers health checks at all)."""
    proc = Process(argv)
    try:
        proc.wait_serving(require=serving)
        yield proc
    finally:
        proc.kill()


def module_argv(module: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", module, *extra]
