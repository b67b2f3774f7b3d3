"""Supervised worker processes (`--workers N`): respawned with backoff, stopped with the
parent's SIGTERM, and dead with it two ways, either enough: PR_SET_PDEATHSIG and the EOF of
a pipe whose only write end the parent holds (`attach_to_parent`, the child's side)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("sluice.supervise")

PARENT_PID_ENV = "SLUICE_PARENT_PID"
SLOT_ENV = "SLUICE_WORKER_SLOT"  # 0 to N-1
PARENT_FD_ENV = "SLUICE_PARENT_FD"  # the pipe's read end
PR_SET_PDEATHSIG = 1


@dataclass
class Backoff:
    """Delays between respawns of one child: `initial` doubling to `maximum`, back to
    `initial` once a child has stayed up `reset_after_s`. The clock is injected."""

    initial_s: float = 0.1
    maximum_s: float = 5.0
    reset_after_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _next: float = field(init=False, default=0.0)
    _since: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._next = self.initial_s

    def started(self) -> None:
        """A child was (re)started now."""
        self._since = self.clock()

    def delay(self) -> float:
        """The child died: how long to wait before starting the next one."""
        if self._since is not None and self.clock() - self._since >= self.reset_after_s:
            self._next = self.initial_s
        delay = self._next
        self._next = min(self.maximum_s, delay * 2)
        return delay


class Supervisor:
    """Keeps `count` children of `argv` running until `stop`. Call from the event loop's
    thread (the main one): PR_SET_PDEATHSIG fires when the *thread* that forked exits."""

    def __init__(
        self,
        argv: Sequence[str],
        count: int,
        *,
        env: dict[str, str] | None = None,
        name: str = "worker",
        backoff: Callable[[], Backoff] = Backoff,
    ) -> None:
        self.argv = list(argv)
        self.count = count
        self.env = dict(os.environ if env is None else env)
        self.name = name
        self._backoff = backoff
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._read_fd, self._write_fd = os.pipe()  # both non-inheritable

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep(slot)) for slot in range(self.count)]

    def _spawn(self, slot: int) -> subprocess.Popen[bytes]:
        env = {
            **self.env,
            PARENT_PID_ENV: str(os.getpid()),
            PARENT_FD_ENV: str(self._read_fd),
            SLOT_ENV: str(slot),  # a respawned worker keeps its metrics port
        }
        return subprocess.Popen(
            self.argv, env=env, stdin=subprocess.DEVNULL, pass_fds=(self._read_fd,)
        )

    async def _keep(self, slot: int) -> None:
        backoff = self._backoff()
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            pid = "-"
            try:
                proc = self._spawn(slot)
            except OSError as exc:
                log.error("%s %d could not start: %s", self.name, slot, exc)
                code: int | None = None
            else:
                pid = str(proc.pid)
                backoff.started()
                self._procs[slot] = proc
                exited: asyncio.Future[int] = loop.create_future()

                def wait(
                    proc: subprocess.Popen[bytes] = proc, done: asyncio.Future[int] = exited
                ) -> None:
                    code = proc.wait()
                    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                        loop.call_soon_threadsafe(_settle, done, code)

                threading.Thread(target=wait, name=f"{self.name}-{slot}-wait", daemon=True).start()
                code = await exited
                if self._stopping.is_set():
                    return
            delay = backoff.delay()
            log.warning(
                "%s %d (pid %s) exited unexpectedly (status %s); respawning in %.1fs",
                self.name,
                slot,
                pid,
                code,
                delay,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            log.info("%s %d respawning", self.name, slot)

    def forward(self, sig: int = signal.SIGTERM) -> None:
        """Stop respawning and pass `sig` on to every child still running."""
        self._stopping.set()
        for proc in self._procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    async def stop(self, timeout: float, sig: int = signal.SIGTERM) -> None:
        """Signal the children, wait up to `timeout` for them, then SIGKILL the rest."""
        self.forward(sig)
        procs = list(self._procs.values())
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                await asyncio.to_thread(proc.wait, max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop in time: killing it", self.name, proc.pid)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _settle(future: asyncio.Future[int], code: int) -> None:
    if not future.done():
        future.set_result(code)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for `sig` when the parent dies (Linux PR_SET_PDEATHSIG); a no-op where
    prctl does not exist (the pipe in `attach_to_parent` covers it there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def attach_to_parent(loop: asyncio.AbstractEventLoop, on_gone: Callable[[], None]) -> bool:
    """In a supervised child: call `on_gone` (once) when the supervisor dies. False when this
    process was not started by a Supervisor."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent is None:
        return False
    die_with_parent(signal.SIGTERM)
    called = False

    def gone() -> None:
        nonlocal called
        if not called:
            called = True
            log.warning("the supervising process %s is gone: stopping", parent)
            on_gone()

    fd_text = os.environ.get(PARENT_FD_ENV)
    if fd_text is not None:
        fd = int(fd_text)

        def readable() -> None:
            try:
                data = os.read(fd, 1)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # EOF: the only write end, the parent's, is closed
                loop.remove_reader(fd)
                gone()

        try:
            os.set_blocking(fd, False)
            loop.add_reader(fd, readable)
        except OSError:
            pass
    if str(os.getppid()) != parent:  # it died before prctl took hold
        loop.call_soon(gone)
    return True
