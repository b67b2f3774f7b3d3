"""The standard grpc.health.v1 service, with Watch streams that end when the process shuts
down: grpc's own servicer keeps them open forever, so a server with a balancer watching it
would wait out its whole grace period before it could stop."""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health, health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthService(health.aio.HealthServicer):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self._closing = asyncio.Event()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        watching = asyncio.ensure_future(super().Watch(request, context))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait([watching, closing], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watching, closing):
                task.cancel()

    async def shut_down(self) -> None:
        """NOT_SERVING for good, told to every watcher, then every Watch stream ends."""
        await self.enter_graceful_shutdown()
        await asyncio.sleep(0)  # let each watcher write the NOT_SERVING it was woken for
        self._closing.set()
