"""The demo cluster of deploy/compose.yaml made by hand from the built image: three servers on
a user-defined network answering to one alias (Docker's DNS answers it with all three, as a
Kubernetes headless Service), a balancer finding them through it. The containers check
their health with the image's own HEALTHCHECK, every 2 s rather than 15 so that the tier
need not wait for it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tests.e2e.harness import wait_for
from tests.images.engine import Engine

ALIAS = "sluice-servers"
SERVER_PORT, BALANCER_PORT = 8001, 8000


@dataclass
class Cluster:
    engine: Engine
    image: str
    network: str
    servers: list[str]
    balancer: str

    @classmethod
    def make(cls, engine: Engine, image: str, name: str, servers: int = 3) -> Cluster:
        made = cls(engine, image, name, [f"{name}-s{i}" for i in range(servers)], f"{name}-b")
        engine.docker("network", "create", name)
        for server in made.servers:
            made.run(server, "--network-alias", ALIAS)
        made.run(
            made.balancer,
            "-e",
            f"SLUICE_PORT={BALANCER_PORT}",
            command=["sluice-balancer", "--backends-dns", f"{ALIAS}:{SERVER_PORT}"],
        )
        made.wait_healthy()
        return made

    def run(self, name: str, *options: str, command: Sequence[str] = ()) -> None:
        # The hostname is the node id the server reports in x-node-id.
        self.engine.docker(
            "run",
            "-d",
            "--name",
            name,
            "--hostname",
            name,
            "--network",
            self.network,
            "--health-interval",
            "2s",
            *options,
            self.image,
            *command,
        )

    def inspect(self, name: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = json.loads(self.engine.docker("inspect", name))
        return found[0]

    def health(self, name: str) -> str:
        return str(self.inspect(name)["State"].get("Health", {}).get("Status", "none"))

    def wait_healthy(self, timeout: float = 180) -> None:
        for name in [*self.servers, self.balancer]:

            def healthy(name: str = name) -> bool:
                return self.health(name) == "healthy"

            wait_for(healthy, f"{name} healthy", timeout)

    def address(self, name: str) -> str:
        return str(self.inspect(name)["NetworkSettings"]["Networks"][self.network]["IPAddress"])

    @property
    def target(self) -> str:
        return f"{self.address(self.balancer)}:{BALANCER_PORT}"
