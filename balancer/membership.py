"""Discovery's list applied to the pool: transports opened for new addresses and closed for
gone ones, health and models reported, readiness told. Transports come from a factory, so
tests hand it fakes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from sluice.balancer.settings import BalancerSettings
from sluice.balancer.upstream import (
    NO_ANSWER,
    REFUSES,
    UNREACHABLE,
    Models,
    Upstream,
    upstream_tls,
)
from sluice.routing.pool import Backend, Pool

log = logging.getLogger("sluice.balancer")
BREAKER_TICK_S = 0.5  # how often readiness is re-told while breakers may reopen


def outage(why: str) -> bool:
    """Whether a backend is out for what a restart shows too (logged at INFO); any other
    finding, such as a TLS mismatch, is the user's to fix (WARNING)."""
    return why in ("", REFUSES, NO_ANSWER) or why.startswith(f"{UNREACHABLE} (")


class Transport(Protocol):
    """What a backend's connection does for membership (upstream.Upstream)."""

    def watch_health(self, report: Callable[[str, bool, str], None]) -> None: ...

    def watch_models(
        self, every_s: float, report: Callable[[Models | None, str], None]
    ) -> None: ...

    async def close(self) -> None: ...


def upstreams(settings: BalancerSettings) -> Callable[[str], Upstream]:
    """The transport to one server as the flags say; SluiceError now for bad TLS files."""
    tls = upstream_tls(settings)

    def connect(address: str) -> Upstream:
        return Upstream(
            address,
            streams=settings.streams,
            max_in_flight=settings.stream_max_in_flight,
            keepalive_s=settings.keepalive_s,
            tls=tls,
            certificate=bool(settings.upstream_tls_cert),
        )

    return connect


class Membership:
    def __init__(
        self,
        pool: Pool,
        connect: Callable[[str], Transport],
        changed: Callable[[], None],
        *,
        models_refresh_s: float,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.pool = pool
        self.connect = connect
        self.changed = changed  # the balancer's readiness may have changed
        self.models_refresh_s = models_refresh_s
        self._sleep = sleep
        self._closing: set[asyncio.Task[None]] = set()

    def apply(self, addresses: list[str]) -> None:
        """Make the pool hold exactly `addresses`: connect the new, close the gone."""
        added, removed = self.pool.set_addresses(addresses)
        for backend in added:
            transport = self.connect(backend.address)
            backend.transport = transport
            transport.watch_health(self._reporter(backend))
            transport.watch_models(self.models_refresh_s, self._learner(backend))
            log.info("backend %s added", backend.address)
        for backend in removed:
            task = asyncio.ensure_future(backend.transport.close())
            self._closing.add(task)  # held until done: a task nobody holds can be collected
            task.add_done_callback(self._closing.discard)
            log.info("backend %s removed", backend.address)
        self.changed()

    def _reporter(self, backend: Backend) -> Callable[[str, bool, str], None]:
        def report(state: str, unreachable: bool, why: str) -> None:
            # `why`: "" when the state is the server's own word.
            if (backend.health, backend.down) != (state, why):
                level = logging.INFO if outage(why) else logging.WARNING
                log.log(
                    level, "backend %s is %s%s", backend.address, state, f": {why}" if why else ""
                )
            backend.health, backend.down = state, why
            if unreachable:
                self.pool.unreachable(backend)
            self.changed()

        return report

    def _learner(self, backend: Backend) -> Callable[[Models | None, str], None]:
        def learn(models: Models | None, default: str) -> None:
            if not self.pool.learn(backend, models, default):
                return
            if models is None:
                log.info("backend %s lists no models: it may take any call", backend.address)
                return
            listed = ", ".join(f"{m} (versions {', '.join(v)})" for m, v in models.items())
            default_is = f"; default {default}" if default else ""
            log.info("backend %s serves %s%s", backend.address, listed or "no model", default_is)

        return learn

    async def tick(self, every_s: float = BREAKER_TICK_S) -> None:
        """Tell readiness every `every_s`: a breaker reopens to probes by time alone."""
        while True:
            await self._sleep(every_s)
            self.changed()

    async def close(self) -> None:
        """Close every backend's transport, and those still closing."""
        for backend in self.pool.backends.values():
            await backend.transport.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
