"""What grpc's status of a failed call leaves out, added to it: which message size limit was
hit and how to raise it, or the TLS mismatch behind a connection that never formed.

Only failed calls come here. A size limit is read off grpc's own words; a connection that
failed before any call went out is looked into with one probe of the target (a TCP connect
and a TLS handshake that checks nothing, then one short read; `PROBE_S` in all), which tells
a TLS port from a plaintext one and sees a port that closes after the handshake because it
wanted a client certificate. The error keeps grpc's code and words, the hint goes first.
"""

from __future__ import annotations

import enum
import re
import socket
import ssl
import time
from dataclasses import dataclass
from typing import cast

import grpc

PROBE_S = 1.0  # the probe's bound, connect to last read
# grpc's words for a message over a limit: whose limit (CLIENT: this process's own), which
# way the message went, its size and the limit.
OVER_LIMIT = re.compile(
    r"(CLIENT|SERVER): (Sent|Received) message larger than max \((\d+) vs\. (\d+)\)"
)
NO_CONNECTION = "failed to connect to all addresses"

CLIENT_LIMIT = (
    "raise this client's limit: max_message_bytes= of SluiceClient or AsyncSluiceClient "
    "(default 64 MiB); sluice predict, health and metadata: --max-message-bytes "
    "[env SLUICE_MAX_MESSAGE_BYTES, which the server and balancer read too]"
)
PEER_LIMIT = (
    "start it with a larger --max-message-bytes (or SLUICE_MAX_MESSAGE_BYTES); a balancer "
    "and each server behind it have their own"
)
WANTS_TLS = (
    "{target} speaks TLS and this client sent plaintext: give tls_ca=PEM, the CA that signed "
    "its certificate (tls=True: the system's CAs); the sluice commands: --tls-ca PEM "
    "[env SLUICE_TLS_CA] or --tls [env SLUICE_TLS]"
)
AND_A_CERTIFICATE = (
    "; it also requires a client certificate: tls_cert= and tls_key= (--tls-cert and "
    "--tls-key [env SLUICE_CLIENT_TLS_CERT, SLUICE_CLIENT_TLS_KEY])"
)
WANTS_CERTIFICATE = (
    "{target} requires a client certificate (mutual TLS) and this client showed none: give "
    "tls_cert= and tls_key=; the sluice commands: --tls-cert PEM --tls-key PEM "
    "[env SLUICE_CLIENT_TLS_CERT, SLUICE_CLIENT_TLS_KEY]"
)
REFUSES_CERTIFICATE = (
    "{target} requires a client certificate and closed the connection after the handshake: "
    "it does not take this one (is it signed by a CA in the server's --tls-client-ca?)"
)
WANTS_PLAINTEXT = (
    "{target} speaks plaintext and this client sent TLS: drop its TLS options (tls, tls_ca, "
    "tls_cert, tls_key, server_name; --tls* and SLUICE_TLS* for the sluice commands), or "
    "start the server with --tls-cert and --tls-key"
)
UNTRUSTED = (
    "this client does not trust {target}'s certificate: tls_ca= (--tls-ca) must hold the CA "
    "that signed it"
)


@dataclass(frozen=True)
class Shown:
    """What a client offered the target: TLS, and a client certificate."""

    tls: bool = False
    certificate: bool = False


class Port(enum.Enum):
    """What one probe found at a port."""

    UNKNOWN = "unknown"  # no connection, or an answer that tells nothing
    TLS = "tls"  # a handshake, then it spoke
    TLS_CLOSED = "tls-closed"  # a handshake (showing no certificate), then it closed
    PLAINTEXT = "plaintext"  # it answered the handshake with bytes that are not TLS


def explained(error: grpc.RpcError, target: str, shown: Shown | None) -> grpc.RpcError:
    """`error` with a hint ahead of grpc's words when there is one (same code, metadata and
    words), else `error` itself. `target`: the one address the call went to ("" if it
    could have been one of several); `shown`: None when the client does not know its
    channels' TLS (no TLS hint then). May probe `target` (`needs_probe`): at most PROBE_S."""
    details = _details(error)
    hint = size_hint(details, target)
    if not hint and shown is not None and target and needs_probe(error):
        hint = tls_hint(details, target, shown, probe(target))
    if not hint:
        return error
    call = cast(grpc.Call, error)  # a failed call's error is its Call too
    return grpc.aio.AioRpcError(
        call.code(),
        grpc.aio.Metadata(*(call.initial_metadata() or ())),
        grpc.aio.Metadata(*(call.trailing_metadata() or ())),
        f"{hint} (grpc: {details})",
        getattr(error, "debug_error_string", lambda: None)(),
    )


def needs_probe(error: grpc.RpcError) -> bool:
    """Whether `explained` would probe: the call failed before any connection was made."""
    code = getattr(error, "code", lambda: None)()
    return code == grpc.StatusCode.UNAVAILABLE and NO_CONNECTION in _details(error)


def size_hint(details: str, target: str) -> str:
    """Which limit a message was over, and how to raise it ("" if none was)."""
    over = OVER_LIMIT.search(details)
    if over is None:
        return ""
    side, way, size, limit = over.groups()
    message = "request" if (side == "CLIENT") == (way == "Sent") else "reply"
    if side == "CLIENT":
        return f"the {message} ({size} bytes) is over this client's limit ({limit}): {CLIENT_LIMIT}"
    peer = f"the server or balancer at {target}" if target else "a server"
    return f"the {message} ({size} bytes) is over the limit of {peer} ({limit}): {PEER_LIMIT}"


def tls_hint(details: str, target: str, shown: Shown, port: Port) -> str:
    """The TLS mismatch between what the client showed and what the probe found ("" if
    none is seen)."""
    if shown.tls and "CERTIFICATE_VERIFY_FAILED" in details:
        return UNTRUSTED.format(target=target)
    if not shown.tls and port in (Port.TLS, Port.TLS_CLOSED):
        more = AND_A_CERTIFICATE if port is Port.TLS_CLOSED else ""
        return WANTS_TLS.format(target=target) + more
    if shown.tls and port is Port.PLAINTEXT:
        return WANTS_PLAINTEXT.format(target=target)
    if shown.tls and port is Port.TLS_CLOSED:
        return (REFUSES_CERTIFICATE if shown.certificate else WANTS_CERTIFICATE).format(
            target=target
        )
    return ""


def probe(target: str, bound_s: float = PROBE_S) -> Port:
    """What answers at `target` (HOST:PORT): a TCP connect, a TLS handshake that checks no
    certificate and shows none, then one read. A gRPC server speaks first once the handshake
    is done (its settings); one that wanted a client certificate closes instead (TLS 1.3
    sends the client's certificate after the client's side of the handshake is done, so
    the refusal comes as the read's end of file or an alert)."""
    address = host_port(target)
    if address is None:
        return Port.UNKNOWN
    deadline = time.monotonic() + bound_s
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only whether it speaks TLS, not whom to trust
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(address, timeout=bound_s) as raw:
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
    except OSError:
        return Port.UNKNOWN


def host_port(target: str) -> tuple[str, int] | None:
    """The host and port of a `HOST:PORT` target (also `[IPv6]:PORT`, `dns:///HOST:PORT`,
    `ipv4:HOST:PORT`); None for other kinds (a Unix socket, several addresses)."""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    host, sep, port = target.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or "," in target or "/" in target:
        return None
    return host, int(port)


def _details(error: grpc.RpcError) -> str:
    return str(getattr(error, "details", lambda: "")() or "")
