"""A program's shared memory registry (sluice.shm.registry) as its settings ask for it
(--shared-memory and its bounds), and the sweep that lets go of the regions whose objects
their callers unlinked: the server's and the balancer's alike."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from sluice.runtime.settings import ProgramSettings
from sluice.shm.registry import Regions

SWEEP_S = 2.0  # how often regions whose object its caller unlinked are let go
# Regions live in the process they were registered with.
ONE_PROCESS = (
    "--shared-memory needs --workers 1: each process would keep its own regions, and a "
    "call may reach another process than the one its regions were registered on"
)


def regions_of(settings: ProgramSettings) -> Regions | None:
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
