"""The gRPC server both programs run: raw-bytes handlers, health, reflection, limits."""

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

# grpc core drops calls past its pending queue with a bare CANCELLED the application never
# sees; its defaults (random past 1,000) lost 130-180 of a 2,000-call burst. Here a burst
# reaches us to be served or refused with a reason, at ~15 KiB a call (~300 MiB at worst).
MAX_PENDING_CALLS = 20_000


# grpc's classes are generic only to type checkers.
Methods: TypeAlias = "Mapping[str, grpc.RpcMethodHandler[bytes, bytes]]"


def new_server(
    services: Mapping[str, Methods],
    gate: Gate,
    *,
    max_message_bytes: int,
    reuseport: bool,
    max_pending_calls: int = MAX_PENDING_CALLS,
) -> tuple[grpc.aio.Server, HealthService]:
    """A server with `services` (the unary handlers behind `gate`), health and reflection."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Off unless wanted: a second process on a taken port must fail, not share it.
            ("grpc.so_reuseport", 1 if reuseport else 0),
            # Balancers ping to find hung servers (`--keepalive-s`); else grpc answers
            # too_many_pings and drops the connection.
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
    """Listen on host:port (TLS when `tls` is given); the port bound. SluiceError saying why
    it cannot."""
    address = f"{host}:{port}"
    try:
        if tls is not None:
            return server.add_secure_port(address, tls)
        return server.add_insecure_port(address)
    except RuntimeError:
        # grpc's words name no cause: a bind of our own finds it.
        why = unbindable(host, port) or (
            "the port is in use, or the address is not on this host (--host)"
        )
        raise SluiceError(f"cannot listen on {address}: {why}") from None


def check_port_free(host: str, port: int) -> None:
    """SluiceError if another process listens on host:port: SO_REUSEPORT (for workers) would
    otherwise silently share it. A probe, not a lock (a small race at start)."""
    if port == 0:
        return
    why = unbindable(host, port)
    if why is not None:
        raise SluiceError(f"cannot listen on {host}:{port}: {why}")


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
            # As grpc's: TIME_WAIT leftovers do not count; any listener, sharing or not, does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
                probe.listen(1)
            except OSError as exc:
                return BIND_ERRORS.get(exc.errno or 0, exc.strerror or str(exc))
    return None
