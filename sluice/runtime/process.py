"""Process plumbing shared by every Sluice command: logging and the event loop. Light on
purpose: the balancer and the perf floors import it without loading ONNX Runtime."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 1 << 20


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it exists: grpc.aio spends less per call on it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def return_large_blocks() -> bool:
    """Have glibc give every block of 1 MiB or more its own mapping, unmapped when freed.
    Its default threshold starts at 128 KiB but rises to the size of each mapped block freed
    (up to 32 MiB): after one large request (a 25 MB body, its parsed copy, its arrays) later
    blocks of that size come from the heap, which kept ~90 MB after each such call and grew
    with every one. A fixed threshold turns that rise off. False where malloc is not glibc's."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
