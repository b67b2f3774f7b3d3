"""The balancer's settings: every one a flag and a `SLUICE_` environment variable."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from sluice.runtime.listener import MAX_PENDING_CALLS
from sluice.runtime.process import LOG_FORMATS
from sluice.runtime.security import SecuritySettings


@dataclass(frozen=True)
class BalancerSettings(SecuritySettings):
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on; 0 picks a free one"})
    backend: list[str] = field(
        default_factory=list, metadata={"help": "a server HOST:PORT (repeatable)", "list": True}
    )
    backends_file: str = field(
        default="", metadata={"help": "file of HOST:PORT lines, re-read when it changes"}
    )
    backends_dns: str = field(
        default="",
        metadata={"help": "NAME:PORT whose addresses are re-resolved (a headless service)"},
    )
    refresh_s: float = field(
        default=2.0, metadata={"help": "how often the backends file and DNS are checked"}
    )
    models_refresh_s: float = field(
        default=1.0,
        metadata={
            "help": "how often each server is asked which models (and versions) it serves; "
            "also at once when it starts serving or answers NOT_FOUND"
        },
    )
    node_id: str = field(default="", metadata={"help": "name in Health (default hostname)"})
    workers: int = field(
        default=1, metadata={"help": "balancer processes sharing the port (SO_REUSEPORT)"}
    )
    balance_factor: float = field(
        default=1.25, metadata={"help": "bounded-load factor c: a backend holds <= c x mean"}
    )
    breaker_failures: int = field(
        default=5, metadata={"help": "consecutive backend failures that open a breaker"}
    )
    breaker_successes: int = field(
        default=2, metadata={"help": "successful probes that close a half-open breaker"}
    )
    breaker_cooldown_s: float = field(
        default=0.5, metadata={"help": "first open period; doubles per trip, with jitter"}
    )
    breaker_max_cooldown_s: float = field(default=30.0, metadata={"help": "longest open period"})
    retry_ratio: float = field(
        default=0.2, metadata={"help": "retries allowed as a share of calls"}
    )
    retry_min_per_s: float = field(
        default=10.0, metadata={"help": "retries always allowed per second"}
    )
    streams: int = field(default=1, metadata={"help": "multiplexed streams per backend"})
    stream_max_in_flight: int = field(
        default=512, metadata={"help": "calls in flight on one stream"}
    )
    ewma_decay_s: float = field(default=5.0, metadata={"help": "latency estimate decay time"})
    keepalive_s: float = field(
        default=1.0,
        metadata={
            "help": "a server silent this long after a ping is hung: pinged (HTTP/2) when "
            "nothing came for 0.3x this, health-checked every 0.15x this; a stopped "
            "server is out within 1.3x this, one whose event loop answers no check for "
            "10x this too"
        },
    )
    max_ejection_percent: float = field(
        default=50.0,
        metadata={
            "help": "most of the live backends (percent, rounded down) that breakers and "
            "outlier ejection may hold out at once; beyond it breakers are overruled "
            "(NOT_SERVING from a server's health watch is never capped)"
        },
    )
    outlier_factor: float = field(
        default=3.0,
        metadata={
            "help": "eject a backend whose mean latency is this many times the others' "
            "median, and count its timeouts as failures (0: off)"
        },
    )
    max_pending_calls: int = field(
        default=MAX_PENDING_CALLS,
        metadata={
            "help": "calls grpc may hold before the balancer takes them; past it grpc drops "
            "them (CANCELLED). Under overload they wait there unseen: about capacity x half "
            "the usual deadline sheds instead"
        },
    )
    default_timeout_s: float = field(
        default=0.0,
        metadata={"help": "deadline for calls that carry none, in seconds (0: none)"},
    )
    max_message_bytes: int = field(
        default=64 * 1024 * 1024, metadata={"help": "largest request or response message"}
    )
    grace_s: float = field(default=10.0, metadata={"help": "on SIGTERM, time for calls to finish"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(
        default="text",
        metadata={
            "help": "text, or json: one JSON object a line (time, level, logger, message, "
            "request_id and trace_id when known)"
        },
    )
    upstream_tls_ca: str = field(
        default="",
        metadata={
            "help": "talk TLS to the servers, trusting these CAs (PEM bundle); without it: "
            "plaintext"
        },
    )
    upstream_server_name: str = field(
        default="",
        metadata={
            "help": "the name the servers' certificates are checked against (DNS discovery "
            "yields IP addresses); default: the backend's host"
        },
    )
    upstream_tls_cert: str = field(
        default="",
        metadata={"help": "client certificate (PEM) shown to servers that require one"},
    )
    upstream_tls_key: str = field(
        default="", metadata={"help": "the private key (PEM) of --upstream-tls-cert"}
    )
    fanout_rows: int = field(
        default=0,
        metadata={
            "help": "a Predict with more rows than this is split into chunks of at most this "
            "many rows, sent in parallel to several servers and merged in order (0: off)"
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
        if bool(self.upstream_tls_cert) != bool(self.upstream_tls_key):
            raise ValueError("--upstream-tls-cert and --upstream-tls-key go together")
        if (self.upstream_tls_cert or self.upstream_server_name) and not self.upstream_tls_ca:
            raise ValueError(
                "--upstream-tls-cert and --upstream-server-name need --upstream-tls-ca"
            )
        if self.fanout_rows < 0:
            raise ValueError("--fanout-rows must not be negative (0: off)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0-65535, not {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0-65535, not {self.metrics_port}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be text or json, not {self.log_format!r}")
        if not (self.backend or self.backends_file or self.backends_dns):
            raise ValueError(
                "give backends: --backend HOST:PORT, --backends-file or --backends-dns"
            )
        for address in self.backend:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--backend {address!r} is not HOST:PORT")
        if self.balance_factor < 1.0:
            raise ValueError("--balance-factor must be at least 1")
        if not 0.1 <= self.keepalive_s <= 300:
            raise ValueError("--keepalive-s must be between 0.1 and 300 seconds")
        for name in (
            "workers",
            "breaker_failures",
            "breaker_successes",
            "streams",
            "max_pending_calls",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.metrics_port and self.metrics_port + self.workers - 1 > 65535:
            raise ValueError("--metrics-port + --workers - 1 must be at most 65535")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError("--max-ejection-percent must be between 0 and 100")
        if self.outlier_factor != 0 and not 1 < self.outlier_factor < 1e6:
            raise ValueError("--outlier-factor must be 0 (off) or more than 1")
        if not 0.01 <= self.models_refresh_s <= 3600:
            raise ValueError("--models-refresh-s must be between 0.01 and 3600 seconds")
        if self.default_timeout_s < 0:
            raise ValueError("--default-timeout-s must not be negative")
        if not self.node_id:
            object.__setattr__(self, "node_id", f"balancer@{socket.gethostname()}")
