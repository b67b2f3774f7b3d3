"""The process harness of the benchmarks and the end-to-end tests: Sluice processes (servers,
balancers, the perf floors) on port 0, the bound address read back from the "listening on
HOST:PORT" log line, readiness from the gRPC health check, every process stopped by its pid."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from sluice.perf.target import cpu_seconds  # a process's utime + stime, one reader of /proc
from sluice.runtime.launch import BIN, wait_serving

__all__ = [
    "BIN",
    "Process",
    "children",
    "cpu_seconds",
    "module_argv",
    "running",
    "server_argv",
    "wait_serving",
]

LISTENING = re.compile(r"listening on ([\d.]+):(\d+)")


class Process:
    """A started Sluice process; its stderr is kept in `lines` for failure messages."""

    def __init__(
        self, argv: Sequence[str], env: dict[str, str] | None = None, start_s: float = 30.0
    ) -> None:
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
        # One thread reads stderr from the start, keeps every line and hands over the address
        # when it is announced: no line can hide in a buffer between a poll and a read.
        self._announced: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.address = self._wait_for_address(timeout=start_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stderr is not None
        announced = False
        for line in self.proc.stderr:
            self.lines.append(line)
            if not announced and (found := LISTENING.search(line)):
                announced = True
                self._announced.put(f"{found[1]}:{found[2]}")
        self._announced.put(None)  # stderr closed: the process ended before announcing

    def _wait_for_address(self, timeout: float) -> str:
        try:
            address = self._announced.get(timeout=timeout)
        except queue.Empty:
            address = None
        else:
            if address is None:  # its stderr closed: let it finish exiting, for its status
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
        if address is None:
            self.kill()
            raise RuntimeError(
                f"{' '.join(self.argv)} did not start (exit status {self.proc.returncode}):\n"
                + self.log()
            )
        return address

    def log(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout: float = 30.0, *, require: bool = True) -> None:
        wait_serving(self.address, timeout, require=require)

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
        """Collect the rest of stderr once the process has exited. A child of its that still
        holds the pipe keeps the reader waiting: then the pipe is left to the reader (closing
        it under a blocked read would block too)."""
        self._reader.join(timeout=10)
        if not self._reader.is_alive() and self.proc.stderr is not None:
            self.proc.stderr.close()


def server_argv(*extra: str, node_id: str = "node", model: Path | None = None) -> list[str]:
    """`sluice-server` on a free port; the bundled model unless `model` is given."""
    chosen = ["--model", str(model)] if model is not None else []
    return [str(BIN / "sluice-server"), *chosen, "--port", "0", "--node-id", node_id, *extra]


@contextmanager
def running(
    argv: Sequence[str],
    *,
    serving: bool = True,
    start_s: float = 30.0,
    env: dict[str, str] | None = None,
) -> Iterator[Process]:
    """A process for the length of the block, from the moment its health check says SERVING
    (or, with `serving=False`, from the moment it answers health checks at all); `start_s`:
    how long it may take to announce its address (a server loads its models first)."""
    proc = Process(argv, env, start_s=start_s)
    try:
        proc.wait_serving(require=serving)
        yield proc
    finally:
        proc.kill()


def module_argv(module: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", module, *extra]


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (Linux: from /proc; zombies left out)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited while we looked
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)
