"""What a port speaks (TLS, TLS wanting a client certificate, plaintext), found by one
bounded handshake: what grpc leaves out when it says only that a connection never formed.

The client's blocking `probe` asks no resolver (one that drops packets has no bound), so it
takes IP literals and localhost only; the balancer's `resolving` resolves within the bound,
since its backends are often names and the wait is the event loop's, not a caller's."""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass

PROBE_S = 1.0  # resolving (where it does) to last read
# grpc's words, for: a connection that never formed; a certificate the caller's CAs do not
# take; a certificate's name.
NO_CONNECTION = "failed to connect to all addresses"
UNTRUSTED_WORDS = ("CERTIFICATE_VERIFY_FAILED", "BAD_SIGNATURE")
NAME_FAILED = "Hostname Verification Check failed"


@dataclass(frozen=True)
class Shown:
    """What a client offered the port, which a probe's finding is read against."""

    tls: bool = False
    certificate: bool = False


class Port(enum.Enum):
    """What one probe found at a port."""

    UNKNOWN = "unknown"  # no connection, or an answer that tells nothing
    TLS = "tls"  # a handshake, then it spoke
    TLS_CLOSED = "tls-closed"  # a handshake (showing no certificate), then it closed
    PLAINTEXT = "plaintext"  # it answered the handshake with bytes that are not TLS


def probe(target: str, bound_s: float = PROBE_S) -> Port:
    """What answers at `target`; UNKNOWN unless its host is an IP literal or localhost."""
    found = split(target)
    address = literal(found[0]) if found else None
    if found is None or address is None:
        return Port.UNKNOWN
    return handshake([(address, found[1])], bound_s)


async def resolving(target: str, bound_s: float = PROBE_S) -> Port:
    """What answers at `target`, resolved first, all within `bound_s`; UNKNOWN if it does
    not resolve in time."""
    found = split(target)
    if found is None:
        return Port.UNKNOWN
    host, port = found
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    address = literal(host)
    try:
        if address is not None:
            addresses = [(address, port)]
        else:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), bound_s
            )
            addresses = [(str(info[4][0]), port) for info in infos]
        left = max(deadline - loop.time(), 0.01)
        return await asyncio.wait_for(asyncio.to_thread(handshake, addresses, left), 2 * left)
    except (OSError, TimeoutError):
        return Port.UNKNOWN


def handshake(addresses: list[tuple[str, int]], bound_s: float) -> Port:
    """What answers at the first of `addresses` that connects, within `bound_s`. A gRPC
    server speaks first (its settings); one that wanted a client certificate closes instead
    (under TLS 1.3 that refusal comes after the handshake, as EOF or an alert)."""
    deadline = time.monotonic() + bound_s
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only whether it speaks TLS, not whom to trust
    context.set_alpn_protocols(["h2"])
    for address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            raw = socket.create_connection(address, timeout=left)
        except OSError:
            continue
        with raw:
            try:
                return _spoken(context, raw, deadline)
            except OSError:
                return Port.UNKNOWN
    return Port.UNKNOWN


def _spoken(context: ssl.SSLContext, raw: socket.socket, deadline: float) -> Port:
    raw.settimeout(max(deadline - time.monotonic(), 0.01))
    try:
        tls = context.wrap_socket(raw)
    except ssl.SSLError as exc:
        return Port.PLAINTEXT if exc.reason == "WRONG_VERSION_NUMBER" else Port.UNKNOWN
    with tls:
        tls.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            return Port.TLS if tls.recv(1) else Port.TLS_CLOSED
        except ssl.SSLError as exc:  # an alert: TLS 1.3's CERTIFICATE_REQUIRED
            return Port.TLS_CLOSED if "CERTIFICATE" in str(exc.reason) else Port.UNKNOWN
        except TimeoutError:
            return Port.TLS  # a TLS port that waits for the client to speak


def split(target: str) -> tuple[str, int] | None:
    """The host (IPv6 unbracketed) and port of a one-address TCP target, else None."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or "," in target or "/" in target:
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


def literal(host: str) -> str | None:
    """The IP address `host` is without asking a resolver (a literal, or localhost), or None."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def untrusted(details: str) -> bool:
    """Whether grpc's `details` say the peer's certificate is not trusted."""
    return any(word in details for word in UNTRUSTED_WORDS)
