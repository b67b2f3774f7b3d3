"""grpc.health.v1 whose Watch streams end on shutdown (grpc's stay open, so a watched server
waited out its grace), and a program's readiness."""

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
        self._changed = asyncio.Event()  # replaced at each change

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        """The status now and at each change; once shut down, the last one, then the end.
        Never cancelled mid-write: grpc core then never ends the call (TOO_MANY_OPERATIONS)."""
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
    """SERVING while `ready()` holds, NOT_SERVING otherwise, silent once draining. The program
    calls `changed` (or `installed`/`removed`, as a listener) when `ready` may have changed."""

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
        self._tasks.add(task)  # a task nobody holds can be collected
        task.add_done_callback(self._tasks.discard)

    installed = removed = changed
