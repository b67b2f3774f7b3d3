"""The balancer's settings: every one a flag and a `SLUICE_` environment variable."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from sluice.routing.breaker import BreakerSettings
from sluice.routing.hedge.flags import HedgeFlags
from sluice.routing.pool import OutlierSettings
from sluice.runtime import config
from sluice.runtime.settings import ProgramSettings


@dataclass(frozen=True)
class BalancerSettings(HedgeFlags, ProgramSettings):
    PROG = "sluice-balancer"
    DESCRIPTION = "Balance Sluice servers behind one address."

    port: int = config.inherit(ProgramSettings, "port", 8000)
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
        # A server added to DNS takes calls within a second; a lookup costs ~0.1 ms.
        default=0.5,
        metadata={"help": "how often the backends file and DNS are checked"},
    )
    models_refresh_s: float = field(
        default=1.0,
        metadata={
            "help": "how often each server is asked which models (and versions) it serves; "
            "also at once when it starts serving or answers NOT_FOUND"
        },
    )
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
        for name in ("workers", "breaker_failures", "breaker_successes", "streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError("--max-ejection-percent must be between 0 and 100")
        if self.outlier_factor != 0 and not 1 < self.outlier_factor < 1e6:
            raise ValueError("--outlier-factor must be 0 (off) or more than 1")
        if not 0.01 <= self.models_refresh_s <= 3600:
            raise ValueError("--models-refresh-s must be between 0.01 and 3600 seconds")
        self.check_processes(self.workers)
        _ = self.hedge  # refused at start if bad

    def processes(self) -> int:
        return self.workers

    def default_node_id(self) -> str:
        return f"balancer@{socket.gethostname()}"

    @property
    def breaker(self) -> BreakerSettings:
        """Each backend's circuit breaker, as the --breaker-* flags set it."""
        return BreakerSettings(
            failures_to_open=self.breaker_failures,
            successes_to_close=self.breaker_successes,
            base_cooldown_s=self.breaker_cooldown_s,
            max_cooldown_s=self.breaker_max_cooldown_s,
        )

    @property
    def outlier(self) -> OutlierSettings:
        """Latency outlier ejection, as --outlier-factor sets it."""
        return OutlierSettings(factor=self.outlier_factor)
