"""A program's shared memory settings (--shared-memory and its bounds), the registry
(sluice.shm.registry) they ask for, and the sweep that lets go of the regions whose objects
their callers unlinked: the server's and the balancer's alike."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from sluice.runtime.security import SecuritySettings
from sluice.shm.registry import Regions

SWEEP_S = 2.0  # how often regions whose object its caller unlinked are let go
# Regions live in the process they were registered with.
ONE_PROCESS = (
    "--shared-memory needs --workers 1: each process would keep its own regions, and a "
    "call may reach another process than the one its regions were registered on"
)


@dataclass(frozen=True)
class SharedMemorySettings(SecuritySettings):
    """The shared memory group of ProgramSettings; over the security group, whose tenants
    make regions copied rather than mapped (`regions_of`)."""

    shared_memory: bool = field(
        default=False,
        metadata={
            "help": "take tensors in POSIX shared memory regions that callers on this host "
            "register (Triton's system shared memory extension, and the sluice.v1 API's); "
            "off: those calls are refused"
        },
    )
    shared_memory_regions: int = field(
        default=64, metadata={"help": "most shared memory regions a tenant may register"}
    )
    shared_memory_bytes: int = field(
        default=4 << 30,
        metadata={"help": "most bytes a tenant's shared memory regions may span together"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_memory_regions < 1 or self.shared_memory_bytes < 1:
            raise ValueError("--shared-memory-regions and --shared-memory-bytes must be positive")

    def check_processes(self, processes: int) -> None:
        """ValueError (ONE_PROCESS) for shared memory on over several processes."""
        if self.shared_memory and processes > 1:
            raise ValueError(ONE_PROCESS)


def regions_of(settings: SharedMemorySettings) -> Regions | None:
    """The registry --shared-memory and its bounds ask for (None: off)."""
    if not settings.shared_memory:
        return None
    return Regions(
        max_regions=settings.shared_memory_regions,
        max_bytes=settings.shared_memory_bytes,
        # Tenants on: callers are not one party, and none may crash the process for the
        # others by truncating its object under a call (SIGBUS): regions are copied in and
        # out (~50 us a 602 KB input) instead of mapped.
        copy=bool(settings.tenants),
    )


async def sweep(regions: Regions, log: logging.Logger, every_s: float = SWEEP_S) -> None:
    """Let go of the regions whose object its caller unlinked (done with it, or gone),
    every `every_s`, each told to `log`, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        for name in regions.sweep():
            log.info("shared memory region %r let go: its object was unlinked", name)


Task = Callable[[], Coroutine[Any, Any, None]]


def sweeps(regions: Regions | None, log: logging.Logger) -> list[Task]:
    """A program's background work for `regions`: their sweep (none when off)."""
    return [] if regions is None else [functools.partial(sweep, regions, log)]


def closers(regions: Regions | None) -> list[Task]:
    """What a program runs once no call is left: `regions` let go (none when off)."""
    if regions is None:
        return []

    async def close() -> None:
        regions.close()

    return [close]
