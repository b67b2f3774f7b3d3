"""The built image: no build secret (PIP_CA) or wheel in its history, and as it runs, its
program (pid 1, not a shell exec'd beside it) as the non-root user the Dockerfile names, and
healthy by the image's own HEALTHCHECK, which asks grpc.health.v1 on SLUICE_PORT (of the
balancer too, which listens on another port)."""

from __future__ import annotations

import pytest

from tests.images.cluster import Cluster
from tests.images.engine import Engine

pytestmark = pytest.mark.images


def test_every_container_runs_as_nobody_and_is_healthy(containers: Cluster) -> None:
    check = containers.inspect(containers.image)["Config"]["Healthcheck"]["Test"]
    assert check[0] == "CMD" and "grpc_health.v1" in check[-1], check
    for name in [*containers.servers, containers.balancer]:
        status = containers.engine.docker("exec", name, "cat", "/proc/1/status")
        (uids,) = [line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")]
        assert uids == ["65534"] * 4, (name, uids)  # real, effective, saved, filesystem
        assert containers.health(name) == "healthy", name


def test_the_image_history_keeps_no_build_secret_or_wheel(docker: Engine, image: str) -> None:
    # What made each layer: a build argument a RUN used, or a folder copied in, shows here.
    made = docker.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image)
    for leak in ("PIP_CA", "BEGIN CERTIFICATE", "/wheels"):
        assert leak not in made, (leak, made)
    assert "/opt/sluice" in made, made
