"""The gRPC server both processes run: raw-bytes Inference handlers, grpc.health.v1 and
reflection (so grpcurl needs no protos), message size limits, and keepalive pings allowed."""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from typing import TypeAlias

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sluice.core.errors import SluiceError
from sluice.runtime.gate import Gate
from sluice.runtime.health import HealthService

# grpc core holds each call that arrives before the application asks for one (grpc.aio asks
# for one call at a time, from its event loop) in a FIFO pending queue, and drops calls past
# its bound with a bare CANCELLED the application never sees. grpc's defaults drop at random
# past 1,000 and all past 3,000: a burst of 2,000 calls at one server lost 130-180. This
# default lets a burst reach the application, which serves it or refuses with a reason; a
# pending call costs grpc core ~15 KiB, so ~300 MiB at worst (soft and hard limit equal: no
# random drops below it). Under sustained overload this queue is where calls wait unseen
# (see --max-pending-calls).
MAX_PENDING_CALLS = 20_000


# A service's handlers by method name (grpc's classes are generic only to type checkers).
Methods: TypeAlias = "Mapping[str, grpc.RpcMethodHandler[bytes, bytes]]"


def new_server(
    services: Mapping[str, Methods],
    gate: Gate,
    *,
    max_message_bytes: int,
    reuseport: bool,
    max_pending_calls: int = MAX_PENDING_CALLS,
) -> tuple[grpc.aio.Server, HealthService]:
    """A server with `services` (full service name -> its handlers by method name; the unary
    ones behind `gate`), health, and reflection of all of them."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Off unless wanted: a second process on a taken port must fail, not share it.
            ("grpc.so_reuseport", 1 if reuseport else 0),
            # Balancers ping a server after 0.3 s without a byte from it (`--keepalive-s`)
            # to find hung ones: allow it (no strikes), or grpc answers too_many_pings and
            # drops the connection.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 500),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.server.max_pending_requests", max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", max_pending_calls),
        ]
    )
    # Registered, not generic: grpc core matches each method itself. Generic handlers are
    # asked in turn, and a call of the second service paid ~5% of its throughput for it.
    for name, methods in services.items():
        server.add_registered_method_handlers(name, gate.handlers(methods))  # type: ignore[attr-defined]
    health = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            *services,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    return server, health


def bind(
    server: grpc.aio.Server, host: str, port: int, tls: grpc.ServerCredentials | None = None
) -> int:
    """Listen on host:port, with TLS when `tls` is given (sluice.runtime.tls); the port bound
    (port 0 picks one). SluiceError if it cannot, saying why."""
    address = f"{host}:{port}"
    try:
        if tls is not None:
            return server.add_secure_port(address, tls)
        return server.add_insecure_port(address)
    except RuntimeError:
        # grpc's words name no cause and send the user to GRPC_VERBOSITY: a bind of our own
        # finds the cause, and when it does bind (a race: the port came free), the likely ones.
        why = unbindable(host, port) or (
            "the port is in use, or the address is not on this host (--host)"
        )
        raise SluiceError(f"cannot listen on {address}: {why}") from None


def check_port_free(host: str, port: int) -> None:
    """SluiceError if another process listens on host:port. For a process about to bind with
    SO_REUSEPORT (its workers join it there), which would otherwise silently share a port
    some other program holds. A probe, not a lock: a process binding between this check and
    the real bind is not seen (a small race, only at start)."""
    if port == 0:
        return  # the kernel picks a free port
    why = unbindable(host, port)
    if why is not None:
        raise SluiceError(f"cannot listen on {host}:{port}: {why}")


# Why a bind failed, by errno, in words that say what to change.
BIND_ERRORS = {
    errno.EADDRINUSE: "the port is in use: another process listens on it",
    errno.EADDRNOTAVAIL: "the address is not on this host (--host: one of its addresses, or "
    "0.0.0.0 for all)",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
}


def unbindable(host: str, port: int) -> str | None:
    """Why a socket cannot listen on host:port, or None if one can (it is closed again)."""
    try:
        infos = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        return f"the host does not resolve: {exc.strerror or exc}"
    for family, kind, proto, _, sockaddr in infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            # SO_REUSEADDR, as grpc's own: TIME_WAIT leftovers of an earlier run do not count;
            # no SO_REUSEPORT, so any listener on the port, sharing or not, makes this fail.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
                probe.listen(1)
            except OSError as exc:
                return BIND_ERRORS.get(exc.errno or 0, exc.strerror or str(exc))
    return None
