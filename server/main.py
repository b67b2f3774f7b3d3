"""`sluice-server`: serve one ONNX model over gRPC until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from grpc_health.v1 import health_pb2

from sluice.core.errors import SluiceError
from sluice.runtime import config, door, metrics, refusals, tracing
from sluice.runtime.health import HealthService
from sluice.runtime.listener import bind, check_port_free, new_server
from sluice.runtime.process import event_loop, return_large_blocks, setup_logging
from sluice.runtime.supervise import attach_to_parent
from sluice.runtime.tls import PLAINTEXT_WARNING, server_credentials
from sluice.runtime.workers import Workers
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import CUDA, choose_providers
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import Dataplane
from sluice.server.dataplane.repository import Repository, load_model
from sluice.server.kserve import SERVICE as KSERVE
from sluice.server.kserve import KServeService
from sluice.server.metrics import DataplaneCollector
from sluice.server.modelconfig import read_config
from sluice.server.service import SERVICE, InferenceService
from sluice.server.settings import ServerSettings

log = logging.getLogger("sluice.server")


class Readiness:
    """grpc.health.v1 says SERVING while at least one model is loaded (a repository may be
    empty at start, or emptied), so orchestrators and balancers send calls only then; a
    listener of `Models`. Once the server drains, it says nothing more."""

    def __init__(self, health: HealthService, names: tuple[str, ...], models: Models) -> None:
        self.health = health
        self.names = names
        self.models = models
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def update(self) -> None:
        if self.draining:
            return
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if len(self.models) else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            await self.health.set(name, status)

    def _changed(self, model: Model) -> None:
        task = asyncio.ensure_future(self.update())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    installed = removed = _changed


WORKERS = Workers("sluice.server.main", "SLUICE_SERVER_WORKER", "SLUICE_SERVER_WORKERS", "worker")


async def serve(settings: ServerSettings, argv: Sequence[str] = ()) -> int:
    tracing.setup("sluice-server")  # on only if OTEL_TRACES_EXPORTER asks for it
    defaults = settings.model_settings()
    # --model entries: loaded, checked and warmed up once, like a repository's versions.
    served = [await load_model(name, "1", Path(path), defaults) for name, path in settings.models()]
    default = settings.default_model or (served[0].name if served else "")
    try:
        models = Models(served, default=default)
    except ValueError as exc:  # two --model files whose graphs have one name
        log.error("%s: name them (--model NAME=PATH)", exc)
        return 1
    repository = None
    if settings.model_repository:
        repository = Repository(
            Path(settings.model_repository),
            models,
            defaults,
            read_config=read_config,
            poll_s=settings.repository_poll_s,
            log=log,
        )
        await repository.poll()  # what is there at start serves from the first call
    plane = Dataplane(models, LRUCache(settings.cache_entries, settings.cache_bytes))
    tenants = door.load(settings.tenants) if settings.tenants else None
    service = InferenceService(
        plane,
        node_id=settings.node_id,
        default_timeout_s=settings.default_timeout_s or None,
        tenants=tenants,
    )
    # KServe v2 beside sluice.v1; its repository calls answer UNIMPLEMENTED unless asked for.
    kserve = KServeService(service, repository=repository if settings.repository_api else None)
    is_worker = WORKERS.is_worker()
    exporter = None
    if settings.metrics_port:
        try:
            exporter = await metrics.start(
                metrics.new_registry(
                    metrics.ServingCollector(service.stats),
                    DataplaneCollector(models, plane.cache),
                    *([metrics.TenantCollector(tenants)] if tenants is not None else []),
                ),
                settings.host,
                WORKERS.metrics_ports(settings.metrics_port, is_worker),
            )
        except OSError as exc:
            log.error("--metrics-port %d: %s", settings.metrics_port, exc)
            return 1
    count = settings.worker_count(gpu=CUDA in choose_providers(settings.device))
    reuseport = count > 1 or is_worker
    server, health_servicer = new_server(
        {SERVICE: service.methods(), KSERVE: kserve.methods()},
        max_message_bytes=settings.max_message_bytes,
        reuseport=reuseport,
        max_pending_calls=settings.max_pending_calls,
    )
    if reuseport and not is_worker:
        check_port_free(settings.host, settings.port)  # its workers join it; no one else
    port = bind(server, settings.host, settings.port, tls=server_credentials(settings))
    if not is_worker and settings.plaintext_off_loopback(settings.host):
        log.warning(PLAINTEXT_WARNING, settings.host, port)
    await server.start()
    ready = Readiness(health_servicer, ("", SERVICE, KSERVE), models)
    await ready.update()
    models.listeners.append(ready)
    watching = asyncio.create_task(repository.run()) if repository is not None else None
    refusal_log = refusals.start(service.stats, log)  # one WARNING line per 10 s, if any
    reloading = (
        asyncio.create_task(door.watch(settings.tenants, tenants, log))
        if tenants is not None
        else None
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if is_worker:
        attach_to_parent(loop, stop.set)  # a worker does not outlive the first process
    workers = WORKERS.start(count, argv, port)
    log.info(
        "node %s serving %s (max batch %d, cache %d entries), listening on %s:%d",
        settings.node_id,
        ", ".join(f"{m.name} {m.version} on {m.engine.provider}" for m in models) or "no model yet",
        settings.max_batch,
        settings.cache_entries,
        settings.host,
        port,
    )
    await stop.wait()

    # Tell health watchers first so balancers stop sending, then refuse new calls and
    # give in-flight ones the grace period.
    log.info("shutting down: draining for up to %.1fs", settings.drain_delay_s + settings.grace_s)
    if workers is not None:
        workers.forward(signal.SIGTERM)  # they drain as this one does
    service.serving = False
    ready.draining = True
    await health_servicer.shut_down()
    if settings.drain_delay_s:
        await asyncio.sleep(settings.drain_delay_s)
    service.start_draining()
    await server.stop(settings.grace_s)
    if watching is not None and repository is not None:
        watching.cancel()
        await repository.close()  # versions being retired finish unloading
    refusal_log.cancel()
    if reloading is not None:
        reloading.cancel()
    await plane.close()  # each model: its running batches, then its engine
    if workers is not None:
        await workers.stop(settings.drain_delay_s + settings.grace_s + 5.0)
    if exporter is not None:
        exporter.close()
    log.info("stopped after %d calls", service.stats.requests)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = config.parse(
            ServerSettings, argv, "sluice-server", "Serve an ONNX model over gRPC."
        )
    except ValueError as exc:
        print(f"sluice-server: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    return_large_blocks()
    try:
        with asyncio.Runner(loop_factory=event_loop) as runner:
            return runner.run(serve(settings, argv))
    except (SluiceError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
