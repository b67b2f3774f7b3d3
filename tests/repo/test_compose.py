"""deploy/compose.yaml, checked without an engine: three servers behind one network alias (the
headless Service of Docker's DNS), a balancer that discovers them by that name on the port
they listen on, all from the image the Dockerfile builds, with the programs' own parsers
reading the commands. tests/images runs a cluster of this shape from the built image."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from sluice.balancer.settings import BalancerSettings
from sluice.runtime import config
from sluice.server.settings import ServerSettings
from tests.repo.test_dockerfile import IMAGE, env

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose.yaml"
SERVICES: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
# ${NAME:-default} as docker-compose reads it with NAME unset.
DEFAULT = re.compile(r"\$\{\w+:-([^}]*)\}")


def unset(value: str) -> str:
    return DEFAULT.sub(r"\1", value)


def servers() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in SERVICES.items() if s["command"][0] == "sluice-server"}


def settings(service: dict[str, Any], cls: type[Any], program: str) -> Any:
    """The program's settings as the container gets them (its command, over its environment,
    over the image's), checked by the settings themselves."""
    command = service["command"]
    assert command[0] == program
    parser = config.build_parser(cls, program, "")
    namespace, unknown = parser.parse_known_args(command[1:])
    assert unknown == [], f"{program}: unknown flags {unknown}"
    environ = {**env(IMAGE), **service.get("environment", {})}
    return config.from_namespace(cls, namespace, environ=environ)


def aliases(service: dict[str, Any]) -> dict[str, list[str]]:
    networks = service["networks"]
    if isinstance(networks, list):
        return {name: [] for name in networks}
    return {name: (spec or {}).get("aliases", []) for name, spec in networks.items()}


def test_three_servers_share_one_alias_on_the_balancers_network() -> None:
    found = servers()
    assert len(found) == 3, sorted(SERVICES)
    shared = [set.intersection(*(set(v) for v in aliases(s).values())) for s in found.values()]
    (alias,) = set.intersection(*shared)
    (balancer,) = set(SERVICES) - set(found)
    assert set(aliases(SERVICES[balancer])) == set(aliases(next(iter(found.values()))))
    assert alias not in SERVICES  # a name of its own: no one service answers for it


def test_the_balancer_discovers_the_servers_by_the_alias_and_their_port() -> None:
    (name,) = set(SERVICES) - set(servers())
    balancer = settings(SERVICES[name], BalancerSettings, "sluice-balancer")
    host, _, port = balancer.backends_dns.rpartition(":")
    for server in servers().values():
        (alias_list,) = aliases(server).values()
        assert host in alias_list
        served = settings(server, ServerSettings, "sluice-server")
        assert served.host == "0.0.0.0"
        assert str(served.port) == port
    # Published on loopback only, on the port the balancer listens on.
    (published,) = SERVICES[name]["ports"]
    address, outside, inside = published.split(":")
    assert address == "127.0.0.1" and inside == str(balancer.port) == outside


def test_every_service_runs_the_image_the_dockerfile_builds() -> None:
    images = {unset(s["image"]) for s in SERVICES.values()}
    assert len(images) == 1, images
    for service in SERVICES.values():
        build = service["build"]
        root = (COMPOSE.parent / build["context"]).resolve()
        assert (root / build.get("dockerfile", "Dockerfile")) == COMPOSE.parents[1] / "Dockerfile"
        # The Dockerfile's own default base unless SLUICE_BASE names another.
        assert unset(build["args"]["BASE"]) == "sluice-base:bookworm"
        assert "ARG BASE=sluice-base:bookworm" in (root / "Dockerfile").read_text()
