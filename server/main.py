"""`sluice-server`: serve one ONNX model over gRPC until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server import config
from server.batcher import Batcher
from server.cache import LRUCache
from server.engine import Engine
from server.errors import SluiceError
from server.health import HealthService
from server.service import SERVICE, InferenceService
from server.settings import ServerSettings
from sluice.v1 import inference_pb2

log = logging.getLogger("sluice.server")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it exists: grpc.aio spends less per call on it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


async def serve(settings: ServerSettings) -> int:
    engine = Engine(
        settings.model,
        device=settings.device,
        intra_op_threads=settings.intra_op_threads,
        instances=settings.instances,
        pool_bytes=settings.buffer_pool_bytes,
        inline_max_s=settings.inline_max_us / 1e6,
    )
    batcher = Batcher(
        engine.instances,
        max_rows=settings.max_batch,
        budget_s=settings.batch_budget_ms / 1000,
        max_queue=settings.max_queue,
    )
    cache = LRUCache(settings.cache_entries, settings.cache_bytes)
    service = InferenceService(engine, batcher, cache, node_id=settings.node_id)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            # A second server on a taken port must fail, not share it silently.
            ("grpc.so_reuseport", 0),
            # Balancers keep idle health watches alive with pings every 10 s: allow them,
            # or grpc answers too_many_pings and drops the connection.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
        ]
    )
    server.add_generic_rpc_handlers([service.handler()])
    health_servicer = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = f"{settings.host}:{settings.port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise SluiceError(f"cannot listen on {address}: {exc}") from None
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "node %s serving %s on %s (max batch %d, cache %d entries), listening on %s:%d",
        settings.node_id,
        engine.name,
        engine.provider,
        settings.max_batch,
        settings.cache_entries,
        settings.host,
        port,
    )
    await stop.wait()

    # Tell health watchers first so balancers stop sending, then refuse new calls and
    # give in-flight ones the grace period.
    log.info("shutting down: draining for up to %.1fs", settings.drain_delay_s + settings.grace_s)
    service.serving = False
    await health_servicer.shut_down()
    if settings.drain_delay_s:
        await asyncio.sleep(settings.drain_delay_s)
    service.start_draining()
    await server.stop(settings.grace_s)
    await batcher.close()
    engine.close()
    log.info("stopped after %d calls", service.stats.requests)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = config.parse(
            ServerSettings, argv, "sluice-server", "Serve an ONNX model over gRPC."
        )
    except ValueError as exc:
        print(f"sluice-server: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    try:
        with asyncio.Runner(loop_factory=event_loop) as runner:
            return runner.run(serve(settings))
    except (SluiceError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
