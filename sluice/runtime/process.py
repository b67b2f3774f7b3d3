"""Process plumbing shared by every Sluice command: logging and the event loop. Light on
purpose: the balancer and the perf floors import it without loading ONNX Runtime."""

from __future__ import annotations

import asyncio
import logging
import sys


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
