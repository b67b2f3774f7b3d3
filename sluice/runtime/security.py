"""The settings for who may connect and call: TLS (optionally mutual) and the tenants file."""

from __future__ import annotations

from dataclasses import dataclass, field

LOOPBACK = ("127.0.0.1", "::1", "[::1]", "localhost")


@dataclass(frozen=True)
class SecuritySettings:
    tls_cert: str = field(
        default="",
        metadata={
            "help": "serve TLS with this certificate chain (PEM), re-read when it changes; "
            "needs --tls-key. Without it: plaintext (warned about off 127.0.0.1)"
        },
    )
    tls_key: str = field(
        default="", metadata={"help": "the private key (PEM) of --tls-cert, re-read with it"}
    )
    tls_client_ca: str = field(
        default="",
        metadata={
            "help": "require client certificates signed by these CAs (PEM bundle): mutual TLS"
        },
    )
    tenants: str = field(
        default="",
        metadata={
            "help": "a TOML file of tenants and their hashed API keys (see `sluice key`), "
            "re-read when it changes: calls must then carry 'authorization: Bearer KEY'"
        },
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def plaintext_off_loopback(self, host: str) -> bool:
        """Whether listening on `host` without TLS exposes plaintext beyond this machine."""
        return not self.tls and host not in LOOPBACK
