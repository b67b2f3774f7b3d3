"""The image as the Dockerfile builds it: the CPU build of ONNX Runtime unless asked for the
GPU one, the manifests' non-root user, a health check through grpc.health.v1, and only the
ports that are open by default. (tests/e2e/test_install.py runs the health check against a
server; docker itself is not needed.)"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        found.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, f"a continuation runs off the end: {pending}"
    return found


def final_stage(text: str) -> list[tuple[str, str]]:
    """The instructions of the image itself: those after the last FROM."""
    steps = instructions(text)
    starts = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    assert starts, "no FROM"
    return steps[starts[-1] :]


def values(stage: list[tuple[str, str]], word: str) -> list[str]:
    return [rest for w, rest in stage if w == word]


def env(stage: list[tuple[str, str]]) -> dict[str, str]:
    found = {}
    for rest in values(stage, "ENV"):
        for pair in shlex.split(rest):
            key, sep, value = pair.partition("=")
            assert sep, f"ENV in the legacy `ENV KEY VALUE` form: {rest}"
            found[key] = value
    return found


def healthcheck(stage: list[tuple[str, str]]) -> list[str]:
    """The HEALTHCHECK's command, in exec form."""
    (check,) = values(stage, "HEALTHCHECK")
    _, sep, command = check.partition("CMD ")
    assert sep, f"HEALTHCHECK without CMD: {check}"
    argv: list[str] = json.loads(command)  # exec form: no shell in between
    return argv


IMAGE = final_stage((REPO / "Dockerfile").read_text())


def manifest_users() -> set[int]:
    """The runAsUser of every Deployment in deploy/."""
    users = set()
    for path in (REPO / "deploy").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Deployment":
                users.add(doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    return users


def test_the_cpu_build_is_the_default_and_the_extra_is_installed() -> None:
    # Installed in the build stage, whose venv the image copies whole.
    build = instructions((REPO / "Dockerfile").read_text())[: -len(IMAGE)]
    args = dict(a.partition("=")[::2] for a in values(build, "ARG"))
    assert args.get("EXTRAS") == "cpu", args
    (install,) = [r for r in values(build, "RUN") if "pip install" in r]
    assert "$EXTRAS" in install or "${EXTRAS" in install, install
    assert "--from=build /opt/sluice /opt/sluice" in values(IMAGE, "COPY")


def test_the_image_keeps_neither_the_wheel_nor_pip_ca() -> None:
    # A build argument a RUN uses is recorded in the image's history; a copied file stays in
    # its layer though a later RUN deletes it.
    assert not [rest for _, rest in IMAGE if "PIP_CA" in rest], IMAGE
    copied = [rest for rest in values(IMAGE, "COPY") if rest.startswith("--from=")]
    assert copied == ["--from=build /opt/sluice /opt/sluice"], copied


def test_the_image_runs_as_the_manifests_non_root_user() -> None:
    users = values(IMAGE, "USER")
    assert users, "no USER: the image runs as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric, so runAsNonRoot can check"
    assert not gid or gid.isdigit()
    assert manifest_users() == {int(uid)}
    words = [w for w, _ in IMAGE]
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")
    # The root filesystem may be read-only and the user's home does not exist: $HOME is /tmp.
    assert env(IMAGE).get("HOME") == "/tmp"


def test_health_is_checked_through_grpc_health_on_the_serving_port() -> None:
    argv = healthcheck(IMAGE)
    assert argv[:2] == ["python", "-c"], argv
    code = argv[2]
    compile(code, "HEALTHCHECK", "exec")
    assert "grpc_health.v1" in code and "SERVING" in code
    assert "SLUICE_PORT" in code  # the port the program listens on, whatever it is set to
    (check,) = values(IMAGE, "HEALTHCHECK")
    # Model (and CUDA) loading is not a failure: as long as the manifests' startup probe.
    assert "--start-period=120s" in check.split()


def test_only_the_serving_port_is_exposed() -> None:
    # Metrics are off unless --metrics-port (SLUICE_METRICS_PORT) asks for them.
    exposed = {p for rest in values(IMAGE, "EXPOSE") for p in rest.split()}
    assert exposed == {env(IMAGE)["SLUICE_PORT"]}
