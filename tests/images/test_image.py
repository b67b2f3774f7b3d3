"""The built image as it runs: its program (pid 1, not a shell exec'd beside it) as the
non-root user the Dockerfile names, and healthy by the image's own HEALTHCHECK, which asks
grpc.health.v1 on SLUICE_PORT (of the balancer too, which listens on another port)."""

from __future__ import annotations

import pytest

from tests.images.cluster import Cluster

pytestmark = pytest.mark.images


def test_every_container_runs_as_nobody_and_is_healthy(cluster: Cluster) -> None:
    check = cluster.inspect(cluster.image)["Config"]["Healthcheck"]["Test"]
    assert check[0] == "CMD" and "grpc_health.v1" in check[-1], check
    for name in [*cluster.servers, cluster.balancer]:
        status = cluster.engine.docker("exec", name, "cat", "/proc/1/status")
        (uids,) = [line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")]
        assert uids == ["65534"] * 4, (name, uids)  # real, effective, saved, filesystem
        assert cluster.health(name) == "healthy", name
