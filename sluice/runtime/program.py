"""The lifecycle every serving program shares, from the command line to the last log line.

`main` parses settings and runs the program's `serve`, which builds a `Program` and hands
it to `run`: listen, wait for SIGTERM, then drain in order (health NOT_SERVING so balancers
stop sending; the drain delay; refuse new calls, the grace for those in flight; background
work; the program's close steps; its workers; the metrics exporter)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client.registry import Collector

from sluice.core.errors import SluiceError
from sluice.core.stats import ServingStats
from sluice.core.tenants import Tenants
from sluice.core.words import counted
from sluice.runtime import config, door, metrics, refusals, tracing
from sluice.runtime.gate import Gate
from sluice.runtime.health import Readiness
from sluice.runtime.listener import Methods, bind, check_port_free, new_server
from sluice.runtime.process import event_loop, return_large_blocks, setup_logging
from sluice.runtime.settings import ProgramSettings
from sluice.runtime.supervise import Supervisor, attach_to_parent
from sluice.runtime.tls import PLAINTEXT_WARNING, server_credentials
from sluice.runtime.workers import Workers

S = TypeVar("S", bound=ProgramSettings)
WORKERS_STOP_S = 5.0  # past the drain, before workers are killed


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Program:
    """What one program brings to the lifecycle; the rest is the same for every program."""

    settings: ProgramSettings
    workers: Workers
    log: logging.Logger
    services: Mapping[str, Methods]
    stats: ServingStats
    readiness: Readiness
    processes: int  # this one included
    banner: Callable[[], str]  # logged before ", listening on HOST:PORT"
    collectors: Sequence[Collector] = ()  # beyond the calls and the tenants
    tenants: Tenants | None = None
    drain_delay_s: float = 0.0
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = ()
    draining: Callable[[], None] = _nothing  # as health goes down
    refusing: Callable[[], None] = _nothing  # after the drain delay, as the listener stops
    closing: Sequence[Callable[[], Awaitable[None]]] = ()  # once no call is left


async def run(program: Program, argv: Sequence[str], stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM or SIGINT (or `stop` is set), then drain; 0 once stopped, 1 if
    the metrics port cannot be had, SluiceError if the port cannot. The close steps run
    either way."""
    settings, log = program.settings, program.log
    is_worker = program.workers.is_worker()
    exporter = workers = None
    try:
        if settings.metrics_port:
            tenants = program.tenants
            registry = metrics.new_registry(
                metrics.ServingCollector(program.stats),
                *program.collectors,
                *([metrics.TenantCollector(tenants)] if tenants is not None else []),
            )
            ports = program.workers.metrics_ports(settings.metrics_port, is_worker)
            try:
                exporter = await metrics.start(registry, settings.host, ports)
            except OSError as exc:
                log.error("--metrics-port %d: %s", settings.metrics_port, exc)
                return 1
        workers = await _serve(program, argv, is_worker, stop)
    finally:
        for close in program.closing:
            await close()
        if workers is not None:
            await workers.stop(program.drain_delay_s + settings.grace_s + WORKERS_STOP_S)
        if exporter is not None:
            exporter.close()
    log.info("stopped after %s", counted(program.stats.requests, "call"))
    return 0


async def _serve(
    program: Program, argv: Sequence[str], is_worker: bool, stop: asyncio.Event | None
) -> Supervisor | None:
    """Listen, serve until stopped, drain; returns the workers."""
    settings, log = program.settings, program.log
    reuseport = program.processes > 1 or is_worker
    gate = Gate(f"{settings.node_id} is draining: another node may take the call")
    server, health = new_server(
        program.services,
        gate,
        max_message_bytes=settings.max_message_bytes,
        reuseport=reuseport,
        max_pending_calls=settings.max_pending_calls,
    )
    if reuseport and not is_worker:
        # Again after loading: a port taken since would be shared silently.
        check_port_free(settings.host, settings.port)
    port = bind(server, settings.host, settings.port, tls=server_credentials(settings))
    if not is_worker and settings.plaintext_off_loopback(settings.host):
        log.warning(PLAINTEXT_WARNING, settings.host, port)
    await server.start()
    program.readiness.attach(health, program.services)
    await program.readiness.publish()
    background = [asyncio.create_task(work()) for work in program.background]
    background.append(refusals.start(program.stats, log))
    if program.tenants is not None:
        background.append(asyncio.create_task(door.watch(settings.tenants, program.tenants, log)))

    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if is_worker:
        attach_to_parent(loop, stop.set)
    workers = program.workers.start(program.processes, argv, port)
    log.info("%s, listening on %s:%d", program.banner(), settings.host, port)
    await stop.wait()

    drain_s = program.drain_delay_s + settings.grace_s
    log.info("shutting down: draining for up to %.1fs", drain_s)
    if workers is not None:
        workers.forward(signal.SIGTERM)
    program.draining()
    program.readiness.draining = True
    await health.shut_down()
    if program.drain_delay_s:
        await asyncio.sleep(program.drain_delay_s)
    program.refusing()
    # Calls in flight end and their replies are read before grpc closes the connections.
    await server.stop(await gate.drain(settings.grace_s))
    for task in background:
        task.cancel()
    return workers


def main(
    settings_class: type[S],
    serve: Callable[[S, list[str]], Awaitable[int]],
    argv: Sequence[str] | None,
    log: logging.Logger,
    errors: tuple[type[Exception], ...] = (SluiceError,),
    workers: Workers | None = None,
) -> int:
    """The command `settings_class` describes: 2 for bad settings, 1 (logged) for one of
    `errors` or a taken port, 130 for an early Ctrl-C, else what `serve` says. The port is
    checked before `serve` loads anything, so a taken one says so at once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = settings_class.PROG
    try:
        settings = config.parse(settings_class, argv, prog, settings_class.DESCRIPTION)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    if workers is None or not workers.is_worker():
        try:
            check_port_free(settings.host, settings.port)
        except SluiceError as exc:
            log.error("%s", exc)
            return 1
    return_large_blocks()

    async def traced() -> int:
        tracing.setup(prog)
        return await serve(settings, argv)

    try:
        with asyncio.Runner(loop_factory=event_loop) as runner:
            return runner.run(traced())
    except errors as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
