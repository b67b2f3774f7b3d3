"""Logging, the event loop and the allocator, for every Sluice command. It imports no grpc
and no ONNX Runtime, so a program can quiet grpc-core before grpc loads."""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import datetime
import json
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from importlib import metadata
from typing import Any

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# Fixed, because glibc's rises to each mapped block freed: after one 25 MB request, later
# blocks that size came from the heap, which kept ~90 MB per such call and kept growing.
MMAP_THRESHOLD = 1 << 20
# At glibc's 128 KiB a 602 KB call's blocks went back to the kernel and were faulted in anew
# by the next call (~550 faults, ~1.3 ms CPU); 32 in flight need 16 MiB (15 faults at 4, 0).
TRIM_THRESHOLD = 16 << 20
# The event loop's and one for all other threads, so ~2 x 16 MiB kept at most; glibc's 8 a
# core held ~45 MiB more at 32 in flight and faulted 3x as often.
ARENA_MAX = 2
# A setting the user names in GLIBC_TUNABLES or glibc's older variable wins.
TUNABLES = "GLIBC_TUNABLES"
MALLOPTS = (
    (M_MMAP_THRESHOLD, MMAP_THRESHOLD, "glibc.malloc.mmap_threshold", "MALLOC_MMAP_THRESHOLD_"),
    (M_TRIM_THRESHOLD, TRIM_THRESHOLD, "glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_"),
    (M_ARENA_MAX, ARENA_MAX, "glibc.malloc.arena_max", "MALLOC_ARENA_MAX"),
)


# grpc-core logs to stderr in its own format whatever --log-format says (a failed handshake
# is an INFO line), and reads this once as grpc loads. GRPC_VERBOSITY=INFO turns it back on.
GRPC_VERBOSITY = "GRPC_VERBOSITY"
GRPC_QUIET = "NONE"

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# Set by whoever handles the call; a record's own `extra=` attributes win.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("sluice_request_id", default="")
TRACE_ID: contextvars.ContextVar[str] = contextvars.ContextVar("sluice_trace_id", default="")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, request_id and trace_id when
    known, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, var in (("request_id", REQUEST_ID), ("trace_id", TRACE_ID)):
            value = getattr(record, name, None) or var.get()
            if not value and name == "trace_id":
                value = _current_trace_id()
            if value:
                line[name] = str(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def _current_trace_id() -> str:
    """The current span's trace id if OpenTelemetry is loaded (never imported here), or ""."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return ""
    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


def quiet_grpc_core(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn grpc-core's own log lines off unless GRPC_VERBOSITY is set; call it before
    anything imports grpc (children inherit it)."""
    if not environ.get(GRPC_VERBOSITY):
        environ[GRPC_VERBOSITY] = GRPC_QUIET


def setup_logging(level: str, fmt: str = "text") -> None:
    """Log to stderr at `level`, as text lines or (`fmt="json"`) JSON lines."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it exists: grpc.aio spends less per call on it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def return_large_blocks(environ: Mapping[str, str] = os.environ) -> bool:
    """Set glibc's allocator for tensors (MALLOPTS), leaving any setting the user gave glibc
    in `environ`. False where malloc is not glibc's, or a setting was refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    named = {item.partition("=")[0].strip() for item in environ.get(TUNABLES, "").split(":")}
    done = True
    for param, value, tunable, variable in MALLOPTS:
        if tunable not in named and variable not in environ:
            done = bool(mallopt(param, value)) and done
    return done


def package_version() -> str:
    """The installed sluice package's version (what ServerMetadata reports)."""
    try:
        return metadata.version("sluice")
    except metadata.PackageNotFoundError:
        return "unknown"
