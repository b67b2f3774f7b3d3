"""What grpc's status of a failed call leaves out, added to it: which message size limit was
hit and how to raise it, or the TLS mismatch behind a connection that never formed.

Only failed calls come here. A size limit, and a certificate this client does not trust, are
read off grpc's own words; a connection that failed before any call went out is looked into
with one probe of the target (sluice.runtime.probe: at most `PROBE_S`, IP literals and
localhost only, a name would be resolved without a bound). What a probe found is kept
`KEEP_S` per target (`Probes`), so a retry loop against a host that drops packets waits for
it once, not on every failed call. The error keeps grpc's code and words, the hint goes first,
in the words of whoever reads it (`Audience`: the Python client's keywords, or the sluice
commands' flags and variables).
"""

from __future__ import annotations

import enum
import re
import threading
import time
from collections.abc import Callable
from typing import cast

import grpc

from sluice.core import limits
from sluice.runtime.probe import NAME_FAILED, NO_CONNECTION, PROBE_S, Port, probe, untrusted
from sluice.runtime.probe import Shown as Shown  # explained()'s: callers name it here

KEEP_S = 10.0  # how long a target's probe result is kept
# grpc's words for a message over a limit: whose limit (CLIENT: this process's own), which
# way the message went, its size and the limit.
OVER_LIMIT = re.compile(
    r"(CLIENT|SERVER): (Sent|Received) message larger than max \((\d+) vs\. (\d+)\)"
)


class Audience(enum.Enum):
    """Who reads a hint, and so which options it names."""

    PYTHON = "python"  # SluiceClient's and AsyncSluiceClient's keyword arguments
    COMMANDS = "commands"  # the sluice commands' flags and SLUICE_ variables


# The hints, in each audience's words; the server's own flags are the same for both.
CLIENT_LIMIT = {
    Audience.PYTHON: "raise this client's limit: max_message_bytes= of SluiceClient or "
    "AsyncSluiceClient (default 64 MiB)",
    Audience.COMMANDS: "raise this command's limit: --max-message-bytes (sluice predict, "
    "health and metadata; default 64 MiB) [env SLUICE_MAX_MESSAGE_BYTES, which the server "
    "and balancer read too]",
}
WANTS_TLS = {
    Audience.PYTHON: "{target} speaks TLS and this client sent plaintext: give tls_ca=PEM, "
    "the CA that signed its certificate (tls=True: the system's CAs)",
    Audience.COMMANDS: "{target} speaks TLS and this command sent plaintext: give --tls-ca "
    "PEM [env SLUICE_TLS_CA], the CA that signed its certificate (--tls [env SLUICE_TLS]: the "
    "system's CAs)",
}
AND_A_CERTIFICATE = {
    Audience.PYTHON: "; it also requires a client certificate: tls_cert= and tls_key=",
    Audience.COMMANDS: "; it also requires a client certificate: --tls-cert PEM --tls-key PEM "
    "[env SLUICE_CLIENT_TLS_CERT, SLUICE_CLIENT_TLS_KEY]",
}
WANTS_CERTIFICATE = {
    Audience.PYTHON: "{target} requires a client certificate (mutual TLS) and this client "
    "showed none: give tls_cert= and tls_key=",
    Audience.COMMANDS: "{target} requires a client certificate (mutual TLS) and this command "
    "showed none: give --tls-cert PEM --tls-key PEM [env SLUICE_CLIENT_TLS_CERT, "
    "SLUICE_CLIENT_TLS_KEY]",
}
REFUSES_CERTIFICATE = (
    "{target} requires a client certificate and closed the connection after the handshake: "
    "it does not take this one (is it signed by a CA in the server's --tls-client-ca?)"
)
WANTS_PLAINTEXT = {
    Audience.PYTHON: "{target} speaks plaintext and this client sent TLS: drop its TLS "
    "options (tls, tls_ca, tls_cert, tls_key, server_name), or start the server with "
    "--tls-cert and --tls-key",
    Audience.COMMANDS: "{target} speaks plaintext and this command sent TLS: drop its --tls* "
    "options and SLUICE_TLS* variables, or start the server with --tls-cert and --tls-key",
}
UNTRUSTED = {
    Audience.PYTHON: "this client does not trust {target}'s certificate: tls_ca= must hold "
    "the CA that signed it",
    Audience.COMMANDS: "this command does not trust {target}'s certificate: --tls-ca [env "
    "SLUICE_TLS_CA] must hold the CA that signed it",
}

OTHER_NAME = {
    Audience.PYTHON: "{target}'s certificate is for another name than this client checks "
    "(server_name=, default the target's host): give a name the certificate holds",
    Audience.COMMANDS: "{target}'s certificate is for another name than this command checks "
    "(--server-name [env SLUICE_SERVER_NAME], default the target's host): give a name the "
    "certificate holds",
}


def explained(
    error: grpc.RpcError,
    target: str,
    shown: Shown | None,
    audience: Audience,
    probes: Probes | None = None,
) -> grpc.RpcError:
    """`error` with a hint ahead of grpc's words when there is one (same code, metadata and
    words), else `error` itself. `target`: the one address the call went to ("" if it
    could have been one of several); `shown`: None when the client does not know its
    channels' TLS (no TLS hint then); `audience`: whose options the hint names. May probe
    `target` (`needs_probe`: at most PROBE_S), through `probes` (None: this process's)."""
    details = _details(error)
    why = _why(error, details, target, shown)
    if why is _Why.SIZE:
        hint = size_hint(details, target, audience)
    elif why is _Why.UNTRUSTED:
        hint = UNTRUSTED[audience].format(target=target)
    elif why is _Why.OTHER_NAME:
        hint = OTHER_NAME[audience].format(target=target)
    elif why is _Why.PROBE:
        port = (probes or PROBES).port(target)
        hint = tls_hint(target, cast(Shown, shown), port, audience)  # known: _why saw it
    else:
        return error
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


def needs_probe(
    error: grpc.RpcError, target: str, shown: Shown | None, probes: Probes | None = None
) -> bool:
    """Whether `explained` would probe now: a connection that never formed, grpc's words do
    not say why, and `target`'s last probe is not kept."""
    why = _why(error, _details(error), target, shown)
    return why is _Why.PROBE and (probes or PROBES).kept(target) is None


class _Why(enum.Enum):
    """What a failed call's hint is read off: grpc's words, or a probe of the target."""

    SIZE = "size"  # a message over a limit
    UNTRUSTED = "untrusted"  # grpc said the certificate is not trusted: no probe
    OTHER_NAME = "other name"  # grpc said the certificate is for another name: no probe
    PROBE = "probe"  # a connection that never formed, grpc's words do not say why


def _why(error: grpc.RpcError, details: str, target: str, shown: Shown | None) -> _Why | None:
    """The one decision `explained` and `needs_probe` share: which hint `error` gets (None:
    none; no TLS hint without `shown` or a `target`)."""
    if OVER_LIMIT.search(details):
        return _Why.SIZE
    if shown is None or not target or not _unavailable(error):
        return None
    if shown.tls and untrusted(details):
        return _Why.UNTRUSTED
    if shown.tls and NAME_FAILED in details:
        return _Why.OTHER_NAME
    return _Why.PROBE if NO_CONNECTION in details else None


def size_hint(details: str, target: str, audience: Audience) -> str:
    """Which limit a message was over, and how to raise it ("" if none was)."""
    over = OVER_LIMIT.search(details)
    if over is None:
        return ""
    side, way, size, limit = over.groups()
    message = "request" if (side == "CLIENT") == (way == "Sent") else "reply"
    if side == "CLIENT":
        raise_it = CLIENT_LIMIT[audience]
        return f"the {message} ({size} bytes) is over this client's limit ({limit}): {raise_it}"
    peer = f"the server or balancer at {target}" if target else "a server"
    return limits.too_large(message, int(size), peer, int(limit))


def tls_hint(target: str, shown: Shown, port: Port, audience: Audience) -> str:
    """The TLS mismatch between what the client showed and what the probe found ("" if
    none is seen)."""
    if not shown.tls and port in (Port.TLS, Port.TLS_CLOSED):
        more = AND_A_CERTIFICATE[audience] if port is Port.TLS_CLOSED else ""
        return WANTS_TLS[audience].format(target=target) + more
    if shown.tls and port is Port.PLAINTEXT:
        return WANTS_PLAINTEXT[audience].format(target=target)
    if shown.tls and port is Port.TLS_CLOSED:
        if shown.certificate:
            return REFUSES_CERTIFICATE.format(target=target)
        return WANTS_CERTIFICATE[audience].format(target=target)
    return ""


class Probes:
    """Each target's last probe result, kept `keep_s` on `clock`: a client that fails call
    after call against one target (a retry loop; a host that drops packets costs a probe
    its whole bound) probes it once in that time. Safe from several threads."""

    def __init__(
        self,
        keep_s: float = KEEP_S,
        bound_s: float = PROBE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep_s = keep_s
        self.bound_s = bound_s
        self.clock = clock
        self._kept: dict[str, tuple[float, Port]] = {}  # target: (until, what was found)
        self._lock = threading.Lock()

    def kept(self, target: str) -> Port | None:
        """What the last probe of `target` found, while it is kept (else None)."""
        with self._lock:
            until, port = self._kept.get(target, (0.0, Port.UNKNOWN))
            return port if self.clock() < until else None

    def port(self, target: str) -> Port:
        """What answers at `target`: the kept result, or a probe's (then kept)."""
        port = self.kept(target)
        if port is not None:
            return port
        port = probe(target, self.bound_s)
        with self._lock:
            now = self.clock()
            # Drop what is no longer kept: the map holds the targets failed on lately.
            self._kept = {t: kept for t, kept in self._kept.items() if kept[0] > now}
            self._kept[target] = (now + self.keep_s, port)
        return port


PROBES = Probes()  # this process's: every client's failed calls share what was found


def _unavailable(error: grpc.RpcError) -> bool:
    return bool(getattr(error, "code", lambda: None)() == grpc.StatusCode.UNAVAILABLE)


def _details(error: grpc.RpcError) -> str:
    return str(getattr(error, "details", lambda: "")() or "")
