"""The standard grpc.health.v1 service, with Watch streams that end when the process shuts
down: grpc's own servicer keeps them open forever, so a server with a balancer watching it
would wait out its whole grace period before it could stop. And what it says: a program's
readiness."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from grpc_health.v1 import health, health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthService(health.aio.HealthServicer):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self._closing = False
        self._changed = asyncio.Event()  # set, and replaced, at each change of status

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        """The status now and at each change; once shut down, the last one, then the end.
        Never cancelled mid-write, as a wrapper of grpc's Watch was: a handler that returns
        with a write pending fails its call in grpc core (TOO_MANY_OPERATIONS) and the call
        never ends, so the server waited out its grace for it."""
        last = None
        while True:
            changed = self._changed
            status = self._server_status.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._closing:
                return
            await changed.wait()

    async def set(self, service: str, status: int) -> None:
        await super().set(service, status)
        self._change()

    async def shut_down(self) -> None:
        """NOT_SERVING for good, told to every watcher, then every Watch stream ends."""
        await self.enter_graceful_shutdown()
        self._closing = True
        self._change()

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class Readiness:
    """What grpc.health.v1 says of a program's services: SERVING while `ready()` holds (a
    server: a model is loaded; a balancer: a backend can take calls), so orchestrators and
    balancers send calls only then. The program calls `changed` whenever what `ready` reads
    may have changed (also as a listener of a served set: `installed`, `removed`); the
    lifecycle attaches the health service once listening and stops it at the drain, after
    which nothing more is said."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready
        self.health: HealthService | None = None
        self.names: tuple[str, ...] = ()
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    def attach(self, health: HealthService, names: Iterable[str]) -> None:
        self.health, self.names = health, ("", *names)

    async def publish(self) -> None:
        if self.draining or self.health is None:
            return
        status = SERVING if self.ready() else NOT_SERVING
        for name in self.names:
            await self.health.set(name, status)

    def changed(self, *_: object) -> None:
        task = asyncio.ensure_future(self.publish())
        self._tasks.add(task)  # held until done: a task nobody holds can be collected
        task.add_done_callback(self._tasks.discard)

    installed = removed = changed
