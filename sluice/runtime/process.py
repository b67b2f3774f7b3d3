"""Process plumbing shared by every Sluice command: logging, the event loop and the
allocator. Light on purpose: the balancer and the perf floors import it without loading ONNX
Runtime, and it imports no grpc, so a program can quiet grpc-core (`quiet_grpc_core`) before
grpc loads."""

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

# glibc's mallopt parameters (malloc.h). What `return_large_blocks` sets with each, and why:
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# Every block of 1 MiB or more in a mapping of its own, unmapped when freed. glibc's default
# starts at 128 KiB but rises to the size of each mapped block freed (up to 32 MiB): after one
# large request (a 25 MB body, its parsed copy, its arrays) later blocks of that size came
# from the heap, which kept ~90 MB after each such call and grew with every one.
MMAP_THRESHOLD = 1 << 20
# Free heap kept at the top of an arena, up to 16 MiB, before it goes back to the kernel. A
# fixed mmap threshold pins this at glibc's 128 KiB default, so a 602 KB tensor's blocks (the
# body, its copies, the arrays) were handed back as each call freed them and faulted in anew
# by the next: ~550 page faults and ~1.3 ms of CPU a call. 4 MiB is enough one call at a
# time; 32 in flight need 16 (faults a call: 15 at 4 MiB, 0 at 16).
TRIM_THRESHOLD = 16 << 20
# Two arenas: the main thread's (the event loop) and one that the other threads (grpc's,
# the models' runners) share, so what the trim threshold keeps is at most ~2 x 16 MiB on any
# machine. glibc's own bound is 8 arenas a core, each keeping up to the trim threshold: with
# it a server at 32 in flight held ~45 MiB more and faulted 3x as often, and a 25 MB request
# left up to 58 MiB behind where 2 arenas leave 34.
ARENA_MAX = 2
# Each with the names the user can set it by instead (GLIBC_TUNABLES, or glibc's older
# variable), which win: a setting named there is left as glibc took it at startup.
TUNABLES = "GLIBC_TUNABLES"
MALLOPTS = (
    (M_MMAP_THRESHOLD, MMAP_THRESHOLD, "glibc.malloc.mmap_threshold", "MALLOC_MMAP_THRESHOLD_"),
    (M_TRIM_THRESHOLD, TRIM_THRESHOLD, "glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_"),
    (M_ARENA_MAX, ARENA_MAX, "glibc.malloc.arena_max", "MALLOC_ARENA_MAX"),
)


# grpc-core (C++) logs to stderr on its own, in its own format, whatever --log-format says
# (a failed TLS handshake is an INFO line there), and reads its level from this variable
# once, as grpc loads. Quiet unless the user sets it: GRPC_VERBOSITY=INFO (or ERROR, DEBUG)
# turns its lines back on.
GRPC_VERBOSITY = "GRPC_VERBOSITY"
GRPC_QUIET = "NONE"

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# The request and trace a log line is about: a record's own attributes (`extra=`) first, else
# these, set by whoever handles the call.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("sluice_request_id", default="")
TRACE_ID: contextvars.ContextVar[str] = contextvars.ContextVar("sluice_trace_id", default="")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, then request_id
    and trace_id when the record or the context has them (trace_id also from OpenTelemetry's
    current span), and the traceback if any."""

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
    """The trace id of OpenTelemetry's current span, when tracing was loaded (never imported
    here) and a span is recording; else ""."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return ""
    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


def quiet_grpc_core(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn grpc-core's own log lines off, unless GRPC_VERBOSITY is set: for a program's
    entry, before anything imports grpc (later it is too late). Processes it starts inherit
    the setting."""
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
    """Set glibc's allocator for tensors (MALLOPTS): blocks of 1 MiB or more mapped on their
    own and unmapped when freed, so a 25 MB request leaves nothing behind; smaller freed
    blocks kept for the next call, up to 16 MiB an arena in two arenas, so a 602 KB call
    reuses warm memory instead of faulting it in anew. A setting the user gave glibc in
    `environ` (GLIBC_TUNABLES=glibc.malloc.trim_threshold=131072, or MALLOC_TRIM_THRESHOLD_)
    is theirs: left as glibc applied it at startup, the others still set. False where malloc
    is not glibc's, or a setting was refused."""
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
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
