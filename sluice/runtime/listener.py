"""The gRPC server both processes run: raw-bytes Inference handlers, grpc.health.v1 and
reflection (so grpcurl needs no protos), message size limits, and keepalive pings allowed."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sluice.core.errors import SluiceError
from sluice.runtime.health import HealthService
from sluice.v1 import inference_pb2


def new_server(
    handler: grpc.GenericRpcHandler[bytes, bytes], *, max_message_bytes: int, reuseport: bool
) -> tuple[grpc.aio.Server, HealthService]:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Off unless wanted: a second process on a taken port must fail, not share it.
            ("grpc.so_reuseport", 1 if reuseport else 0),
            # Balancers keep idle health watches alive with pings every 10 s: allow them,
            # or grpc answers too_many_pings and drops the connection.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
        ]
    )
    server.add_generic_rpc_handlers([handler])
    health = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    return server, health


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Listen on host:port; the port bound (port 0 picks one). SluiceError if it cannot."""
    address = f"{host}:{port}"
    try:
        return server.add_insecure_port(address)
    except RuntimeError as exc:
        raise SluiceError(f"cannot listen on {address}: {exc}") from None
