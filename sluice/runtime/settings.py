"""The settings every serving program shares, each declared once (flag, `SLUICE_` variable,
help and checks); a program's own settings class derives from this one, and this one from
the groups kept with what they set (TLS and tenants, shared memory)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from sluice.runtime.listener import MAX_PENDING_CALLS
from sluice.runtime.process import LOG_FORMATS
from sluice.shm.setup import SharedMemorySettings


@dataclass(frozen=True)
class ProgramSettings(SharedMemorySettings):
    PROG = "sluice"
    DESCRIPTION = ""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    # Each program declares its own default again (config.inherit), keeping this help.
    port: int = field(default=0, metadata={"help": "port to listen on; 0 picks a free one"})
    node_id: str = field(
        default="",
        metadata={
            "help": "name reported in Health and by a server in x-node-id (default hostname; "
            "a balancer's balancer@hostname)"
        },
    )
    max_pending_calls: int = field(
        default=MAX_PENDING_CALLS,
        metadata={
            "help": "calls grpc may hold before the program takes them; past it grpc drops them "
            "(CANCELLED, uncounted). Under overload they wait there unseen: about capacity x "
            "half the usual deadline sheds instead (e.g. 64 for the digits model at 100 ms)"
        },
    )
    default_timeout_s: float = field(
        default=0.0,
        metadata={"help": "deadline for calls that carry none, in seconds (0: none)"},
    )
    max_message_bytes: int = field(
        default=64 * 1024 * 1024, metadata={"help": "largest request or response message"}
    )
    grace_s: float = field(
        default=10.0, metadata={"help": "on SIGTERM, how long in-flight calls may take to finish"}
    )
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(
        default="text",
        metadata={
            "help": "text, or json: one JSON object a line (time, level, logger, message, "
            "request_id and trace_id when known)"
        },
    )
    metrics_port: int = field(
        default=0,
        metadata={
            "help": "serve Prometheus metrics at http://HOST:THIS/metrics on --host (0: off); "
            "with --workers N each process is its own scrape target: worker i (0 the first "
            "process) on this + i, so N ports from this one"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0-65535, not {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0-65535, not {self.metrics_port}")
        if self.metrics_port and self.metrics_port + self.processes() - 1 > 65535:
            raise ValueError("--metrics-port + --workers - 1 must be at most 65535")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be text or json, not {self.log_format!r}")
        if self.max_pending_calls < 1:
            raise ValueError("--max-pending-calls must be at least 1")
        if self.max_message_bytes < 1024:
            raise ValueError("--max-message-bytes must be at least 1024")
        if self.grace_s < 0:
            raise ValueError("--grace-s must not be negative")
        if self.default_timeout_s < 0:
            raise ValueError("--default-timeout-s must not be negative")
        if not self.node_id:
            object.__setattr__(self, "node_id", self.default_node_id())

    def processes(self) -> int:
        """The most processes `--workers` may start (each takes a metrics port)."""
        return 1

    def default_node_id(self) -> str:
        return socket.gethostname()
