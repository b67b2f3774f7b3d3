"""Hot swap under load: versions dropped into a watched repository take traffic without a
failed call, through a balancer in front of two servers; old versions unload; a broken file
is refused and the version before it keeps serving."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from tests.conftest import scale_model
from tests.e2e.harness import BIN, Process, running, server_argv, wait_for, wait_health

pytestmark = pytest.mark.e2e

MODEL = "scale"
WIDTH = 4


def drop(repository: Path, version: int, content: bytes) -> None:
    """Put a version in place the way a deployment should: written aside, then renamed in,
    so the watcher never sees half a file."""
    staging = repository / f".{MODEL}-{version}.tmp"
    staging.mkdir()
    (staging / "model.onnx").write_bytes(content)
    os.rename(staging, repository / MODEL / str(version))


def served(address: str) -> list[str]:
    """The versions of MODEL a server reports ready."""
    health = wait_health(address, lambda h: True, "a health report")
    return next((list(m.versions) for m in health.models if m.name == MODEL), [])


@dataclass
class Answer:
    started: float
    ended: float
    node: str
    version: str
    ok: bool


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Path, list[Process], Process]]:
    repository = tmp_path / "repository"
    (repository / MODEL).mkdir(parents=True)
    drop(repository, 1, scale_model(1.0, WIDTH))
    watch = ("--model-repository", str(repository), "--repository-poll-s", "0.1")
    with (
        running(server_argv(*watch, node_id="a")) as a,
        running(server_argv(*watch, node_id="b")) as b,
        running(
            [
                str(BIN / "sluice-balancer"),
                "--port",
                "0",
                "--backend",
                a.address,
                "--backend",
                b.address,
            ]
        ) as balancer,
    ):
        yield repository, [a, b], balancer


def test_versions_swap_in_under_load_without_a_failed_call(
    watched: tuple[Path, list[Process], Process],
) -> None:
    repository, servers, balancer = watched
    answers: list[Answer] = []
    failures: list[str] = []
    rng = np.random.default_rng(0)

    async def load(stop: asyncio.Event) -> None:
        async with AsyncSluiceClient(balancer.address, timeout=10) as client:

            async def worker() -> None:
                while not stop.is_set():
                    x = rng.standard_normal((1, WIDTH)).astype(np.float32)
                    started = time.monotonic()
                    try:
                        got = await client.infer({"x": x}, model=MODEL, no_cache=True)
                    except Exception as exc:  # every failure is a defect: keep them all
                        failures.append(repr(exc))
                        continue
                    factor = float(got.version)
                    ok = np.allclose(got.outputs["y"], x * factor)
                    answers.append(Answer(started, time.monotonic(), got.node_id, got.version, ok))

            await asyncio.gather(*(worker() for _ in range(6)))

    async def swaps() -> None:
        stop = asyncio.Event()
        loading = asyncio.create_task(load(stop))
        try:
            for version in (2, 3, 4):
                await asyncio.sleep(0.3)  # traffic on the old version first
                drop(repository, version, scale_model(float(version), WIDTH))
                for proc in servers:  # swapped in, and the old one unloaded
                    await asyncio.to_thread(
                        wait_for,
                        lambda p=proc, v=version: served(p.address) == [str(v)],
                        f"version {version} alone on {proc.address}",
                    )
            await asyncio.sleep(0.3)
        finally:
            stop.set()
            await loading

    asyncio.run(swaps())

    assert failures == []
    assert len(answers) > 100
    assert all(a.ok for a in answers), "an answer did not match the version that gave it"
    assert {a.version for a in answers} == {"1", "2", "3", "4"}
    # On each server, once a version has answered a call, no call that began after that
    # answer gets an older version: the swap is atomic and never goes back.
    for node in ("a", "b"):
        mine = sorted((a for a in answers if a.node == node), key=lambda a: a.ended)
        ends = [a.ended for a in mine]
        newest = list(itertools.accumulate((int(a.version) for a in mine), max))
        for answer in mine:
            done = bisect.bisect_left(ends, answer.started)  # answers ended before it began
            assert done == 0 or int(answer.version) >= newest[done - 1], (node, answer)
    for proc in servers:
        assert "version 1 unloaded" in proc.log().replace("'", ""), proc.log()[-2000:]


def test_a_broken_version_is_refused_and_the_old_one_keeps_serving(
    watched: tuple[Path, list[Process], Process],
) -> None:
    repository, servers, balancer = watched
    drop(repository, 2, b"this is not an ONNX model")
    for proc in servers:
        wait_for(lambda p=proc: "version 2" in p.log() and "refused" in p.log(), "the refusal")
        assert served(proc.address) == ["1"]
    with SluiceClient(balancer.address) as client:
        x = np.ones((1, WIDTH), np.float32)
        got = client.infer({"x": x}, model=MODEL)
        assert got.version == "1" and np.allclose(got.outputs["y"], x)
