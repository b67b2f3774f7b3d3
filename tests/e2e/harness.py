"""The end-to-end harness: real Sluice processes on port 0 (perf.launch), with the
CPU forced so the tests behave alike on any machine. Waits poll something a process reports,
with a bound that only guards against a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from perf.launch import BIN, Process, children, module_argv, running
from perf.launch import server_argv as _server_argv
from perf.tls import loopback, running_tls
from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.server.dataplane.admission import WARMUP
from sluice.v1 import inference_pb2 as pb

__all__ = [
    "BIN",
    "NOT_INLINE",
    "Cluster",
    "Process",
    "alive",
    "balancer_argv",
    "children",
    "grpcurl",
    "hold_the_instance",
    "kill_strays",
    "loopback",
    "module_argv",
    "rows",
    "running",
    "running_server",
    "running_tls",
    "server_argv",
    "start_cluster",
    "wait_arrived",
    "wait_for",
    "wait_health",
    "write_listing",
]

T = TypeVar("T")

# Every run goes through the queue, whatever this machine's speed makes of the model.
NOT_INLINE = ("--inline-max-us", "0")


def server_argv(*extra: str, node_id: str = "test-node", model: Path | None = None) -> list[str]:
    return _server_argv("--device", "cpu", *extra, node_id=node_id, model=model)


@contextmanager
def running_server(*extra: str, node_id: str = "test-node") -> Iterator[Process]:
    with running(server_argv(*extra, node_id=node_id)) as proc:
        yield proc


def grpcurl(*args: str, plaintext: bool = True) -> str:
    """grpcurl's output (the binary the dev extra installs), plaintext unless told (then `args`
    give -cacert and the rest); raises on failure."""
    out = subprocess.run(
        [str(BIN / "grpcurl"), *(["-plaintext"] if plaintext else []), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


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


def listening(proc: Process) -> int:
    """How many processes have announced `proc`'s port (its workers share its stderr)."""
    line = f"listening on {proc.address}"
    return sum(line in text for text in list(proc.lines))


def workers(proc: Process, count: int) -> list[int]:
    """`proc`'s `count` live workers, once there are that many."""

    def probe() -> list[int] | None:
        found = sorted(pid for pid in children(proc.pid) if alive(pid))
        return found if len(found) == count else None

    return wait_for(probe, f"{count} workers")


@contextmanager
def with_workers(argv: list[str], count: int, marker: bytes) -> Iterator[Process]:
    """A program started with `count` processes in all, each listening; any worker (its
    command line holds `marker`) still running at the end is killed: a stray holds the
    stderr pipe."""
    seen: set[int] = set()
    with running(argv) as proc:
        try:
            wait_for(lambda: listening(proc) == count, "every worker to listen")
            seen.update(workers(proc, count - 1))
            yield proc
        finally:
            seen.update(children(proc.pid))
            if proc.proc.poll() is not None:
                kill_strays(seen, marker)
    kill_strays(seen, marker)


def rows(count: int, seed: int) -> list[np.ndarray]:
    """`count` one-row inputs for the 64-wide models (digits, the MLPs)."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(0, 16, (1, 64)).astype(np.float32) for _ in range(count)]


async def hold_the_instance(
    client: AsyncSluiceClient, server: str, *, blocker_rows: int, seed: int
) -> asyncio.Task[dict[str, np.ndarray]]:
    """Teach the server (through `client`) a run's fixed and per-row cost with runs of two
    sizes, then start one call of `blocker_rows` rows and return it once it holds the
    server's only instance: what is sent next has seconds of work ahead of it."""
    for i, x in enumerate(rows(WARMUP, seed=seed)):
        await client.predict({"input": x.repeat(256 if i % 2 else 1, axis=0)})
    blocker = rows(1, seed=seed + 1)[0].repeat(blocker_rows, axis=0)
    holding = asyncio.create_task(client.predict({"input": blocker}))
    await asyncio.to_thread(
        wait_health, server, lambda h: h.batcher.busy_instances == 1, "the long call to hold"
    )
    return holding


def balancer_argv(*backends: str, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [str(BIN / "sluice-balancer"), "--port", "0", "--node-id", "test-balancer"]
    for address in backends:
        argv += ["--backend", address]
    return argv + list(extra)


@dataclass
class Cluster:
    servers: list[Process]
    balancer: Process
    stack: ExitStack = field(repr=False)

    def health(self) -> pb.HealthResponse:
        with SluiceClient(self.balancer.address) as client:
            return client.health()

    def backend(self, address: str) -> pb.BackendStatus:
        return next(b for b in self.health().backends if b.address == address)


def start_cluster(
    stack: ExitStack,
    count: int = 3,
    *balancer_extra: str,
    server_extra: tuple[str, ...] = (),
    listing: Path | None = None,
) -> Cluster:
    """`count` servers behind a balancer; with `listing`, the balancer learns the servers from
    that backends file (re-read every 0.1 s) rather than from flags."""
    servers = [
        stack.enter_context(running(server_argv(*server_extra, node_id=f"server-{i}")))
        for i in range(count)
    ]
    addresses = [s.address for s in servers]
    if listing is not None:
        write_listing(listing, addresses)
        balancer_extra = ("--backends-file", str(listing), "--refresh-s", "0.1", *balancer_extra)
        addresses = []
    balancer = stack.enter_context(running(balancer_argv(*addresses, extra=balancer_extra)))
    return Cluster(servers, balancer, stack)


def write_listing(listing: Path, addresses: list[str], comment: str = "the servers") -> None:
    """A backends file, replaced in one step so the balancer never reads half of it."""
    partial = listing.with_suffix(".partial")
    partial.write_text(f"# {comment}\n" + "".join(f"{a}\n" for a in addresses))
    os.replace(partial, listing)
