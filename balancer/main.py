"""`sluice-balancer`: the sidecar balancer in front of Sluice servers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence

from grpc_health.v1 import health_pb2

from sluice.balancer.discovery import Discovery
from sluice.balancer.kserve import SERVICE as KSERVE
from sluice.balancer.kserve import KServeFacade
from sluice.balancer.metrics import RoutingCollector
from sluice.balancer.service import SERVICE, BalancerService
from sluice.balancer.settings import BalancerSettings
from sluice.balancer.upstream import Models, Upstream, upstream_tls
from sluice.core.errors import SluiceError
from sluice.routing.breaker import BreakerSettings
from sluice.routing.budget import RetryBudget
from sluice.routing.pool import Backend, OutlierSettings, Pool
from sluice.runtime import config, door, metrics, refusals, tracing
from sluice.runtime.listener import bind, check_port_free, new_server
from sluice.runtime.process import event_loop, return_large_blocks, setup_logging
from sluice.runtime.supervise import SLOT_ENV, attach_to_parent
from sluice.runtime.tls import PLAINTEXT_WARNING, server_credentials
from sluice.runtime.workers import Workers

log = logging.getLogger("sluice.balancer")
WORKER_ENV = "SLUICE_BALANCER_WORKER"  # set in the extra worker processes
WORKERS_ENV = "SLUICE_BALANCER_WORKERS"  # in a worker: how many processes there are in all
WORKER_SLOT_ENV = SLOT_ENV  # in a worker: its slot among the extra processes (supervisor)
WORKERS = Workers("sluice.balancer.main", WORKER_ENV, WORKERS_ENV, "balancer worker")


async def serve(settings: BalancerSettings, argv: Sequence[str]) -> int:
    tracing.setup("sluice-balancer")  # on only if OTEL_TRACES_EXPORTER asks for it
    pool = Pool(
        breaker=BreakerSettings(
            failures_to_open=settings.breaker_failures,
            successes_to_close=settings.breaker_successes,
            base_cooldown_s=settings.breaker_cooldown_s,
            max_cooldown_s=settings.breaker_max_cooldown_s,
        ),
        balance_factor=settings.balance_factor,
        ewma_decay_s=settings.ewma_decay_s,
        rng=random.Random(),
        max_ejection_percent=settings.max_ejection_percent,
        outlier=OutlierSettings(factor=settings.outlier_factor),
    )
    budget = RetryBudget(settings.retry_ratio, settings.retry_min_per_s)
    try:
        tenants = door.load(settings.tenants) if settings.tenants else None
    except SluiceError as exc:
        log.error("%s", exc)
        return 1
    service = BalancerService(
        pool,
        budget,
        node_id=settings.node_id,
        default_timeout_s=settings.default_timeout_s or None,
        fanout_rows=settings.fanout_rows,
        tenants=tenants,
    )
    background: set[asyncio.Task[None]] = set()

    def spawn(work: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(work)
        background.add(task)  # held until done: a task nobody holds can be collected
        task.add_done_callback(background.discard)

    async def publish_health() -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if pool.serving()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE, KSERVE):
            await health_servicer.set(name, status)

    def reporter(backend: Backend) -> Callable[[str, bool], None]:
        def report(state: str, unreachable: bool) -> None:
            if backend.health != state:
                log.info("backend %s is %s", backend.address, state)
            backend.health = state
            if unreachable:
                pool.unreachable(backend)
            spawn(publish_health())

        return report

    def learner(backend: Backend) -> Callable[[Models | None, str], None]:
        def learn(models: Models | None, default: str) -> None:
            if not pool.learn(backend, models, default):
                return
            if models is None:
                log.info("backend %s lists no models: it may take any call", backend.address)
                return
            listed = ", ".join(f"{m} (versions {', '.join(v)})" for m, v in models.items())
            default_is = f"; default {default}" if default else ""
            log.info("backend %s serves %s%s", backend.address, listed or "no model", default_is)

        return learn

    def apply(addresses: list[str]) -> None:
        added, removed = pool.set_addresses(addresses)
        for backend in added:
            upstream = Upstream(
                backend.address,
                streams=settings.streams,
                max_in_flight=settings.stream_max_in_flight,
                keepalive_s=settings.keepalive_s,
                tls=to_servers,
            )
            backend.transport = upstream
            upstream.watch_health(reporter(backend))
            upstream.watch_models(settings.models_refresh_s, learner(backend))
            log.info("backend %s added", backend.address)
        for backend in removed:
            spawn(backend.transport.close())
            log.info("backend %s removed", backend.address)
        spawn(publish_health())

    is_worker = WORKERS.is_worker()
    reuseport = settings.workers > 1 or is_worker
    server, health_servicer = new_server(
        {SERVICE: service.methods(), KSERVE: KServeFacade(service).methods()},
        max_message_bytes=settings.max_message_bytes,
        reuseport=reuseport,
        max_pending_calls=settings.max_pending_calls,
    )
    try:
        if reuseport and not is_worker:
            # Its workers join it on the port; another balancer must not.
            check_port_free(settings.host, settings.port)
        port = bind(server, settings.host, settings.port, tls=server_credentials(settings))
        to_servers = upstream_tls(settings)  # read now: a bad file stops the start
        if not is_worker and settings.plaintext_off_loopback(settings.host):
            log.warning(PLAINTEXT_WARNING, settings.host, port)
    except SluiceError as exc:
        log.error("%s", exc)
        return 1
    await server.start()
    exporter = None
    if settings.metrics_port:
        try:
            exporter = await metrics.start(
                metrics.new_registry(
                    metrics.ServingCollector(service.stats),
                    RoutingCollector(pool, budget, service.planner, service.fanned),
                    *([metrics.TenantCollector(tenants)] if tenants is not None else []),
                ),
                settings.host,
                WORKERS.metrics_ports(settings.metrics_port, is_worker),
            )
        except OSError as exc:
            log.error("--metrics-port %d: %s", settings.metrics_port, exc)
            await server.stop(None)
            return 1
    discovery = Discovery(settings.backend, settings.backends_file, settings.backends_dns)
    watching = asyncio.create_task(discovery.watch(settings.refresh_s, apply))

    async def breaker_clock() -> None:
        # Breakers reopen to probes by time alone; re-publish health at that pace.
        while True:
            await asyncio.sleep(0.5)
            await publish_health()

    refreshing = asyncio.create_task(breaker_clock())
    refusal_log = refusals.start(service.stats, log)  # one WARNING line per 10 s, if any
    background_tasks = [watching, refreshing, refusal_log]
    if tenants is not None:
        background_tasks.append(asyncio.create_task(door.watch(settings.tenants, tenants, log)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if is_worker:
        attach_to_parent(loop, stop.set)  # a worker does not outlive the first process
    workers = WORKERS.start(settings.workers, argv, port)
    log.info(
        "%s balancing %d backends, listening on %s:%d",
        settings.node_id,
        len(settings.backend),
        settings.host,
        port,
    )
    await stop.wait()

    log.info("shutting down: draining for up to %.1fs", settings.grace_s)
    if workers is not None:
        workers.forward(signal.SIGTERM)
    await health_servicer.shut_down()
    await server.stop(settings.grace_s)
    for task in background_tasks:
        task.cancel()
    for backend in pool.backends.values():
        await backend.transport.close()
    if workers is not None:
        # They drain for grace_s as this one did; a little more, then SIGKILL.
        await workers.stop(settings.grace_s + 5.0)
    if exporter is not None:
        exporter.close()
    log.info("stopped after %d calls", service.stats.requests)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = config.parse(
            BalancerSettings, argv, "sluice-balancer", "Balance Sluice servers behind one address."
        )
    except ValueError as exc:
        print(f"sluice-balancer: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    return_large_blocks()
    with asyncio.Runner(loop_factory=event_loop) as runner:
        return runner.run(serve(settings, argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
