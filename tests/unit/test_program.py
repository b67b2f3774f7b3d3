"""The shared program lifecycle, in this process on 127.0.0.1 port 0: health follows the
program's readiness, and the drain runs its steps in order; main's exit codes."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.core.errors import SluiceError
from sluice.core.stats import ServingStats
from sluice.runtime import program
from sluice.runtime.health import Readiness
from sluice.runtime.settings import ProgramSettings
from sluice.runtime.workers import Workers

log = logging.getLogger("sluice.test.program")


class Settings(ProgramSettings):
    PROG = "test"


WORKERS = Workers("nothing", "SLUICE_TEST_PROGRAM_WORKER", "SLUICE_TEST_PROGRAM_WORKERS", "w")


@dataclass
class Steps:
    """What the program's hooks saw, in order."""

    seen: list[str]
    ready: bool = False


def make(steps: Steps, listening: asyncio.Event, **settings: object) -> program.Program:
    readiness = Readiness(lambda: steps.ready)

    async def background() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            steps.seen.append("background cancelled")

    async def close() -> None:
        steps.seen.append(f"closed, health draining {readiness.draining}")

    def banner() -> str:
        listening.set()
        return "test program"

    return program.Program(
        ProgramSettings(port=0, **settings),  # type: ignore[arg-type]
        WORKERS,
        log,
        services={},
        stats=ServingStats(),
        readiness=readiness,
        processes=1,
        banner=banner,
        background=[background],
        draining=lambda: steps.seen.append(f"draining, health draining {readiness.draining}"),
        refusing=lambda: steps.seen.append(f"refusing, health draining {readiness.draining}"),
        closing=[close],
    )


async def health_of(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return int(answer.status)


async def test_health_follows_readiness_and_the_drain_runs_in_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    steps = Steps(seen=[])
    listening, stop = asyncio.Event(), asyncio.Event()
    the_program = make(steps, listening)
    with caplog.at_level(logging.INFO, logger=log.name):
        running = asyncio.create_task(program.run(the_program, [], stop=stop))
        await listening.wait()  # set as the banner is made, just before it is logged
        bound = re.search(r"test program, listening on 127\.0\.0\.1:(\d+)", caplog.text)
        assert bound is not None, caplog.text
        port = int(bound.group(1))
        assert await health_of(port) == health_pb2.HealthCheckResponse.NOT_SERVING
        steps.ready = True
        await the_program.readiness.publish()
        assert await health_of(port) == health_pb2.HealthCheckResponse.SERVING
        stop.set()
        assert await running == 0
        await asyncio.sleep(0)
    assert steps.seen[:2] == [
        "draining, health draining False",  # the program's step comes first
        "refusing, health draining True",  # health said NOT_SERVING before refusing
    ]
    assert sorted(steps.seen[2:]) == ["background cancelled", "closed, health draining True"]
    assert "stopped after 0 calls" in caplog.text


async def test_a_taken_metrics_port_stops_the_start(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        steps = Steps(seen=[])
        the_program = make(steps, asyncio.Event(), metrics_port=taken.getsockname()[1])
        assert await program.run(the_program, [], stop=asyncio.Event()) == 1
    assert "--metrics-port" in caplog.text
    assert steps.seen == ["closed, health draining False"]  # what it opened still closes


def test_main_exit_codes(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    async def refuse(settings: ProgramSettings, argv: list[str]) -> int:
        raise SluiceError(f"cannot listen on {settings.host}:{settings.port}")

    async def serve(settings: ProgramSettings, argv: list[str]) -> int:
        return 7

    def main(serve: Callable[[ProgramSettings, list[str]], Awaitable[int]], argv: list[str]) -> int:
        return program.main(Settings, serve, argv, log)

    assert main(serve, ["--port", "70000"]) == 2
    assert "test: --port must be 0-65535" in capsys.readouterr().err
    assert main(refuse, ["--port", "9"]) == 1
    assert "cannot listen on 127.0.0.1:9" in caplog.text
    assert main(serve, []) == 7
