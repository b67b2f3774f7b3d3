"""The images tier: the Dockerfile built on the base scripts/make-base makes, and the demo
cluster run from it as containers, with faults made through the engine (kill, pause,
network disconnect). Skips, saying why, where no image can be built (not Linux, not root,
no docker client, no engine and no dockerd to start). The session removes every
container, network and image it made, failed or not, and then checks that none is left
and that net.ipv4.ip_forward is as it found it."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from tests.images.cluster import Cluster
from tests.images.engine import PREFIX, Engine, docker_engine, ip_forward, why_not

RUN = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"  # this session's prefix


@pytest.fixture(scope="session")
def docker() -> Iterator[Engine]:
    if reason := why_not():
        pytest.skip(reason)
    forwarding = ip_forward()
    try:
        with docker_engine() as found:
            try:
                yield found
            finally:
                found.close(RUN)
                left = found.leftovers(RUN)
                assert not left, f"the images tier left {left}"
    except LookupError as exc:
        pytest.skip(str(exc))
    assert ip_forward() == forwarding, f"net.ipv4.ip_forward was {forwarding}, now {ip_forward()}"


@pytest.fixture(scope="session")
def image(docker: Engine) -> str:
    tag = f"{RUN}:latest"
    docker.build(tag)
    return tag


@pytest.fixture(scope="session")
def containers(docker: Engine, image: str) -> Cluster:
    return Cluster.make(docker, image, f"{RUN}-net")
