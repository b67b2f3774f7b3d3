"""TLS credentials: a listener's, re-read when its files change on disk, and a channel's.

grpc asks the fetcher at each handshake; it stats the files and re-reads only on a change,
so a renewed certificate serves new connections without a restart. Files that fail to load
log one WARNING and the last good configuration stays."""

from __future__ import annotations

import logging
import re
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from sluice.core.errors import SluiceError
from sluice.core.files import Stamp
from sluice.core.files import stamp as file_stamp
from sluice.runtime.security import SecuritySettings

log = logging.getLogger("sluice.tls")

# Not worded "listening on": that phrase announces the bound address to the process harness.
PLAINTEXT_WARNING = (
    "plaintext on %s:%d, no TLS: anyone who can reach it can call it; give --tls-cert and --tls-key"
)


class ServerFiles:
    """A listener's certificate, key and (for mutual TLS) client CA bundle, as files."""

    def __init__(self, cert: str, key: str, client_ca: str = "") -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._paths = [p for p in (cert, key, client_ca) if p]
        self._lock = threading.Lock()  # grpc may fetch from several of its threads
        self._seen: tuple[Stamp | None, ...] = ()
        self.reloads = 0

    def load(self) -> grpc.ServerCertificateConfiguration:
        """The configuration the files hold now; SluiceError if they do not hold one."""
        stamp = tuple(map(file_stamp, self._paths))
        try:
            # Parsed here, so a broken file fails now rather than every handshake later.
            ssl.create_default_context().load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ssl.create_default_context(cafile=self.client_ca)
            key, chain = Path(self.key).read_bytes(), Path(self.cert).read_bytes()
            roots = Path(self.client_ca).read_bytes() if self.client_ca else None
        except (OSError, ssl.SSLError) as exc:
            raise SluiceError(f"TLS files {', '.join(self._paths)}: {exc}") from None
        finally:
            self._seen = stamp  # tried: only a further change is tried again
        return grpc.ssl_server_certificate_configuration([(key, chain)], roots)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher: a new configuration if the files changed and load, else None."""
        with self._lock:
            if tuple(map(file_stamp, self._paths)) == self._seen:
                return None
            try:
                config = self.load()
            except SluiceError as exc:
                log.warning("%s; still serving the certificate loaded before", exc)
                return None
            self.reloads += 1
            log.info("TLS certificate %s reloaded", self.cert)
            return config

    def credentials(self) -> grpc.ServerCredentials:
        # The stubs say the fetcher never returns None; grpc documents None as "no change".
        return grpc.dynamic_ssl_server_credentials(
            self.load(),
            self.fetch,  # type: ignore[arg-type]
            require_client_authentication=bool(self.client_ca),
        )


def server_credentials(settings: SecuritySettings) -> grpc.ServerCredentials | None:
    """A listener's TLS credentials (None: plaintext); SluiceError if the files do not load."""
    if not settings.tls:
        return None
    return ServerFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca).credentials()


@dataclass(frozen=True)
class FileNames:
    """How a client's TLS files are named in its errors (formats of the path: a keyword, a flag)."""

    ca: str
    cert: str
    key: str


KEYWORDS = FileNames("tls_ca={!r}", "tls_cert={!r}", "tls_key={!r}")  # SluiceClient's


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS: credentials and the name the server's certificate is checked against
    (empty: the target's host)."""

    credentials: grpc.ChannelCredentials
    server_name: str = ""

    @classmethod
    def of(
        cls,
        *,
        tls: bool = False,
        ca: str = "",
        cert: str = "",
        key: str = "",
        server_name: str = "",
        names: FileNames = KEYWORDS,
    ) -> ClientTLS | None:
        """TLS if any option asks for it (None: plaintext), the files read now. OSError if
        one does not load, named as `names` do; ValueError for a certificate without key."""
        if not asks_for_tls(tls, ca, cert, key, server_name):
            return None
        return cls(channel_credentials(ca, cert, key, names), server_name)

    def options(self) -> list[tuple[str, str]]:
        # The target's host may be an IP address from DNS discovery.
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def asks_for_tls(tls: bool, *files_or_name: str) -> bool:
    """Whether a client's options ask for TLS: `tls`, or any file or server name given."""
    return tls or any(files_or_name)


def aio_channel(
    target: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A grpc.aio channel to `target`, with TLS when `tls` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, tls.credentials, [*options, *tls.options()])


def blocking_channel(
    target: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to `target`, with TLS when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, tls.credentials, [*options, *tls.options()])


def channel_credentials(
    ca: str = "", cert: str = "", key: str = "", names: FileNames = KEYWORDS
) -> grpc.ChannelCredentials:
    """A client's TLS credentials (CAs in `ca`, else the system's; `cert` with `key` for
    mutual TLS). OSError if a file does not load, naming it as `names` do."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate and its key go together")
    # Each file read on its own, so the one missing is named (ssl's error names none).
    ca_pem, cert_pem, key_pem = (
        _read(path, name) if path else None
        for path, name in ((ca, names.ca), (cert, names.cert), (key, names.key))
    )
    # Parsed here too, so a wrong file is named now, not as a failed handshake later.
    if ca:
        try:
            ssl.create_default_context(cafile=ca)
        except OSError as exc:  # ssl.SSLError: no certificate in it
            raise _named(exc, names.ca.format(ca)) from None
    if cert:
        try:
            ssl.create_default_context().load_cert_chain(cert, key)
        except OSError as exc:  # ssl.SSLError: not PEM, or not each other's
            raise _named(exc, f"{names.cert.format(cert)} with {names.key.format(key)}") from None
    return grpc.ssl_channel_credentials(ca_pem, key_pem, cert_pem)


def _read(path: str, name: str) -> bytes:
    """A TLS file's bytes; an OSError of its kind naming it."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{name.format(path)}: no such file") from None
    except OSError as exc:
        raise _named(exc, name.format(path)) from None


def _named(exc: OSError, what: str) -> OSError:
    """`exc` of the same kind, its words (less ssl's C source place) after `what`."""
    said = re.sub(r" \(_ssl\.c:\d+\)$", "", exc.strerror or str(exc))
    if isinstance(exc, ssl.SSLError):  # shown as its words only when given an errno too
        return ssl.SSLError(exc.errno, f"{what}: {said}")
    return type(exc)(f"{what}: {said[:1].lower()}{said[1:]}")
