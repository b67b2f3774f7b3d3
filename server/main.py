"""`sluice-server`: serve one ONNX model over gRPC until SIGTERM or SIGINT."""

from __future__ import annotations

from sluice.runtime.process import quiet_grpc_core

# For `python -m` (workers run so): quiet grpc-core before the imports below load grpc.
if __name__ == "__main__":
    quiet_grpc_core()
    try:  # no ONNX Runtime: one line that says what to install, as sluice.entry ends with
        import sluice.server.dataplane.engine  # noqa: F401
    except ImportError as exc:
        if exc.name != "onnxruntime":
            raise
        raise SystemExit(str(exc)) from None

import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from sluice.core.errors import SluiceError
from sluice.runtime import door, program
from sluice.runtime.health import Readiness
from sluice.runtime.workers import Workers
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import CUDA, choose_providers
from sluice.server.dataplane.models import Models
from sluice.server.dataplane.plane import Dataplane
from sluice.server.dataplane.repository import Repository, load_model
from sluice.server.kserve import SERVICE as KSERVE
from sluice.server.kserve import KServeService
from sluice.server.metrics import DataplaneCollector
from sluice.server.modelconfig import read_config
from sluice.server.service import SERVICE, InferenceService
from sluice.server.settings import ServerSettings
from sluice.shm.setup import closers, regions_of, sweeps

log = logging.getLogger("sluice.server")


WORKERS = Workers("sluice.server.main", "SLUICE_SERVER_WORKER", "SLUICE_SERVER_WORKERS", "worker")


async def serve(
    settings: ServerSettings, argv: Sequence[str] = (), stop: asyncio.Event | None = None
) -> int:
    """Serve until SIGTERM or SIGINT, or until `stop` is set (then with no signal handlers)."""
    processes = settings.worker_count(gpu=CUDA in choose_providers(settings.device))
    try:
        settings.check_processes(processes)
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    defaults = settings.model_settings()
    # --model entries: loaded, checked and warmed up once, like a repository's versions.
    served = [
        await load_model(name, "1", Path(path), settings.model_settings(name))
        for name, path in settings.models()
    ]
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
    regions = regions_of(settings)
    service = InferenceService(
        plane,
        node_id=settings.node_id,
        default_timeout_s=settings.default_timeout_s or None,
        tenants=tenants,
        max_message_bytes=settings.max_message_bytes,
        regions=regions,
    )
    # KServe v2 beside sluice.v1; its repository calls answer UNIMPLEMENTED unless asked for.
    kserve = KServeService(service, repository=repository if settings.repository_api else None)
    readiness = Readiness(lambda: len(models) > 0)  # a repository may be empty, or emptied
    models.listeners.append(readiness)

    def draining() -> None:
        service.serving = False

    async def close() -> None:
        if repository is not None:
            await repository.close()  # versions being retired finish unloading
        await plane.close()  # each model: its running batches, then its engine
        for closer in closers(regions):  # no call is left to write into one
            await closer()

    background = [repository.run] if repository is not None else []
    background += sweeps(regions, log)

    def banner() -> str:
        # The cache among its one model's settings, else once after them all.
        listed = [f"{m.name} {m.version} on {m.engine.provider} ({m.describe()}" for m in models]
        cache = f"cache {settings.cache_entries} entries"
        if len(listed) == 1:
            served = f"{listed[0]}, {cache})"
        else:
            served = f"{', '.join(f'{s})' for s in listed) or 'no model'}; {cache}"
        return f"node {settings.node_id} serving {served}"

    return await program.run(
        program.Program(
            settings,
            WORKERS,
            log,
            services={SERVICE: service.methods(), KSERVE: kserve.methods()},
            stats=service.stats,
            readiness=readiness,
            processes=processes,
            banner=banner,
            collectors=[DataplaneCollector(models, plane.cache)],
            tenants=tenants,
            drain_delay_s=settings.drain_delay_s,
            background=background,
            draining=draining,
            refusing=service.start_draining,
            closing=[close],
        ),
        argv,
        stop,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return program.main(
        ServerSettings, serve, argv, log, (SluiceError, FileNotFoundError), workers=WORKERS
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
