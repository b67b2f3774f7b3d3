"""What one scenario of the fault suite or the noisy-neighbour benchmark holds: its processes
(each stopped by its pid at the end), its loads spread over the load-generator pool, a
scratch folder; and the plain text table both print."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

from perf.drive import Drive, drive_in_process
from perf.launch import BIN, Process, children, server_argv
from sluice.client import SluiceClient
from sluice.perf import loadgen

LOAD_PROCS = 2  # load-generator processes


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def rss_mb(pid: int) -> float | None:
    """VmRSS of `pid` in MB (Linux), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def port_of(address: str) -> str:
    return address.rpartition(":")[2]


class Bench:
    """What one scenario holds: its processes (each stopped by its pid at the end), the
    load-generator pool, a scratch folder, and the durations (`quick` shortens them)."""

    def __init__(self, pool: ProcessPoolExecutor, workdir: Path, quick: bool) -> None:
        self.pool = pool
        self.workdir = workdir
        self.quick = quick
        self.procs: dict[str, Process] = {}
        self.workers: set[int] = set()  # balancer workers seen: stopped by pid too
        self.stopped: set[int] = set()  # SIGSTOPped pids, resumed before they are killed

    def seconds(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def start(self, name: str, argv: Sequence[str]) -> Process:
        proc = Process(argv)
        self.procs[name] = proc
        proc.wait_serving()
        return proc

    def server(self, name: str, *extra: str, model: Path | None = None, port: str = "0") -> Process:
        argv = server_argv("--device", "cpu", *extra, "--port", port, node_id=name, model=model)
        return self.start(name, argv)

    def servers(self, prefix: str, count: int, *extra: str) -> list[Process]:
        """`count` servers started together (named prefix-s0, -s1, ...), once all serve."""
        started = []
        for i in range(count):
            name = f"{prefix}-s{i}"
            argv = server_argv("--device", "cpu", *extra, "--port", "0", node_id=name)
            self.procs[name] = proc = Process(argv)
            started.append(proc)
        for proc in started:
            proc.wait_serving()
        return started

    def balancer(self, backends: Sequence[str], *extra: str, name: str = "balancer") -> Process:
        listing = self.workdir / f"{name}.backends"
        write_listing(listing, backends)
        argv = [
            str(BIN / "sluice-balancer"),
            *("--port", "0", "--node-id", name),
            *("--backends-file", str(listing), "--refresh-s", "0.1"),
            *extra,
        ]
        proc = self.start(name, argv)
        # Faults are measured from a settled start: every backend known and SERVING.
        with SluiceClient(proc.address) as client:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                health = client.health(timeout=5)
                states = [b.health for b in health.backends]
                if len(states) == len(backends) and set(states) == {"SERVING"}:
                    break
                time.sleep(0.02)
        return proc

    def rss(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for name, proc in self.procs.items():
            if proc.proc.poll() is None and (mb := rss_mb(proc.pid)) is not None:
                found[name] = mb
                for i, pid in enumerate(children(proc.pid)):
                    self.workers.add(pid)
                    if (child := rss_mb(pid)) is not None:
                        found[f"{name}/worker{i + 1}"] = child
        return found

    def load(self, target: str, *, procs: int = LOAD_PROCS, **kwargs: Any) -> list[Future[Any]]:
        """Submit one load to `procs` load-generator processes; `concurrency`, `rate` and
        `total` are split among them. Starts 0.3 s from now in all of them at once."""
        concurrency = int(kwargs.pop("concurrency", 0))
        rate = float(kwargs.pop("rate", 0.0))
        total = int(kwargs.pop("total", 1_000_000))
        start_at = float(kwargs.pop("start_at", time.monotonic() + 0.3))
        base = random.randrange(10**6) * loadgen.SWEEP_STRIDE  # unique bodies stay unique
        specs = [
            Drive(
                target=target,
                concurrency=concurrency // procs + (i < concurrency % procs),
                rate=rate / procs,
                total=total // procs + (i < total % procs),
                first_call=base + i * loadgen.PROCESS_STRIDE,
                start_at=start_at,
                seed=base + i,
                **kwargs,
            )
            for i in range(procs)
        ]
        return [self.pool.submit(drive_in_process, s) for s in specs]

    def stop(self, name: str) -> None:
        """Stop one process by its pid (SIGKILL) and forget it."""
        self.procs.pop(name).kill()

    def stop_all(self) -> None:
        for pid in self.stopped:
            with suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        for proc in reversed(list(self.procs.values())):
            self.workers.update(children(proc.pid))
            with suppress(Exception):
                proc.kill()
        for pid in self.workers:  # a worker outlives its parent only briefly (PDEATHSIG)
            with suppress(OSError):
                if b"sluice" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def write_listing(listing: Path, addresses: Sequence[str]) -> None:
    partial = listing.with_suffix(".partial")
    partial.write_text("".join(f"{a}\n" for a in addresses))
    os.replace(partial, listing)


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))
