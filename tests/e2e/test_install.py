"""An installed Sluice works anywhere, not only inside the repository: the wheel holds the one
`sluice` namespace with the bundled model, its samples and the protos, and its commands serve
and answer from another directory. Of perf/ it holds only what `sluice perf` runs: the
benchmarks, their floors, model makers and the process harness stay in the checkout.

The wheel is built from a copy of what the Dockerfile copies into the image, so a folder the
package needs and the image lacks fails here too. ONNX Runtime comes in two builds that both
provide the `onnxruntime` module and break each other: the wheel asks for neither by itself
(`pip install sluice` is the client), the CPU build with the `cpu` extra and the GPU build
with `gpu`, which a fresh venv checks from the package index."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.e2e.harness import Process
from tests.repo.test_dockerfile import IMAGE, healthcheck

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# Every sluice/x the wheel must hold: the shared layers and the linked top-level folders.
PACKAGES = ["core", "routing", "wire", "runtime", "v1", "models"]
PACKAGES += ["server", "balancer", "client", "perf"]
# What `sluice perf` imports: the wheel's whole sluice/perf.
SWEEP = ["__init__", "sweep", "loadgen", "h2engine", "histograms", "report", "target"]
PIP = [sys.executable, "-m", "pip", "--no-input", "--disable-pip-version-check", "--quiet"]
# Each build of ONNX Runtime and the one extra that installs it.
RUNTIMES = {"onnxruntime": "cpu", "onnxruntime-gpu": "gpu"}
# Where both builds exist, and where only the CPU one does.
PLATFORMS = [
    {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux"},
    {"sys_platform": "darwin", "platform_machine": "arm64", "platform_system": "Darwin"},
]
ONE_RUNTIME = (
    "import importlib.metadata as m;"
    "print(sorted(d.metadata['Name'].lower() for d in m.distributions()"
    " if d.metadata['Name'].lower().startswith('onnxruntime')))"
)
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist", "results")


def dockerfile_sources() -> list[str]:
    """The repository paths the Dockerfile copies into its build stage."""
    sources = []
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] != ["COPY"] or words[1].startswith("--from="):  # from a stage, not the repo
            continue
        assert not any(w.startswith("--") for w in words), f"unexpected COPY form: {line}"
        *srcs, dest = words[1:]
        for src in srcs:  # `COPY a b ./` or `COPY a a`: each lands at its own path
            assert dest in ("./", ".", src), f"COPY that moves {src} to {dest}: {line}"
            sources.append(src)
    return sources


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built without build isolation (no network) from the Dockerfile's copy of the
    repository (links kept as links), so no stale build/ folder of the checkout leaks in."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    for name in dockerfile_sources():
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=SKIP)
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    out = root / "wheel"
    subprocess.run(
        [
            *PIP,
            "wheel",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (wheel,) = out.glob("sluice-*.whl")
    return wheel


@pytest.fixture(scope="module")
def names(build: Path) -> set[str]:
    with zipfile.ZipFile(build) as wheel:
        return set(wheel.namelist())


@pytest.fixture(scope="module")
def installed(build: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed alone into a folder (its dependencies come from this venv)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [*PIP, "install", "--no-index", "--no-deps", "--target", str(target), str(build)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return target


def test_the_wheel_holds_only_the_sluice_namespace(names: set[str]) -> None:
    top = {name.split("/")[0] for name in names}
    assert "sluice" in top
    assert all(t == "sluice" or re.fullmatch(r"sluice-[^/]+\.dist-info", t) for t in top), top
    for package in PACKAGES:
        assert f"sluice/{package}/__init__.py" in names, package


def test_the_wheel_holds_the_model_its_samples_and_the_protos(names: set[str]) -> None:
    assert "sluice/models/digits.onnx" in names
    assert "sluice/py.typed" in names
    samples = sorted(p.name for p in (REPO / "sluice" / "models" / "samples").iterdir())
    assert "samples.json" in samples and len(samples) == 11  # ten digits and their labels
    for sample in samples:
        assert f"sluice/models/samples/{sample}" in names, sample
    protos = sorted(p.name for p in (REPO / "protos" / "sluice" / "v1").glob("*.proto"))
    assert protos
    for proto in protos:
        assert f"sluice/v1/{proto}" in names, proto
    for generated in ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"):
        assert f"sluice/v1/{generated}" in names, generated


def test_the_wheel_holds_the_sweep_and_none_of_the_benchmark_tree(names: set[str]) -> None:
    # No top-level perf (the first test): the benchmarks could only hide under sluice/perf,
    # and the model maker beside the model.
    swept = {name for name in names if name.startswith("sluice/perf/")}
    assert swept == {f"sluice/perf/{module}.py" for module in SWEEP}, swept
    samples = (REPO / "sluice" / "models" / "samples").iterdir()
    models = {"sluice/models/__init__.py", "sluice/models/digits.onnx"}
    models |= {f"sluice/models/samples/{p.name}" for p in samples}
    assert {name for name in names if name.startswith("sluice/models/")} == models


def elsewhere(installed: Path) -> dict[str, str]:
    """The environment of a user outside the repository: the installed wheel first."""
    return {**os.environ, "PYTHONPATH": str(installed), "PYTHONSAFEPATH": "1"}


@contextmanager
def serving(argv: list[str], env: dict[str, str]) -> Iterator[Process]:
    proc = Process(argv, env=env)
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.terminate()


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Run a command as a user elsewhere does; its stdout, or a failure showing its stderr."""
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def test_the_installed_commands_serve_and_answer_from_any_directory(
    installed: Path, tmp_path: Path
) -> None:
    env = elsewhere(installed)
    check = (
        "import sluice, sluice.models as m;"
        "from sluice import SluiceClient, AsyncSluiceClient;"
        "import sluice.server.main, sluice.balancer.main, sluice.perf.sweep;"
        f"assert sluice.__file__.startswith({str(installed)!r}), sluice.__file__;"
        "assert m.DIGITS.is_file() and [s.label for s in m.samples()] == list(range(10))"
    )
    run([sys.executable, "-c", check], tmp_path, env)
    # No top-level folder of the checkout comes with the wheel.
    stray = (
        "import importlib.util;"
        "stray = [n for n in ('server', 'balancer', 'client', 'perf', 'models')"
        " if importlib.util.find_spec(n)];"
        "assert not stray, stray"
    )
    run([sys.executable, "-c", stray], tmp_path, env)
    sluice = str(installed / "bin" / "sluice")
    # No --model: the server serves the bundled digits model from the package.
    server_argv = [str(installed / "bin" / "sluice-server"), "--port", "0", "--device", "cpu"]
    with serving([*server_argv, "--node-id", "wheel"], env) as server:
        answer = run(
            [sluice, "predict", "--sample", "3", "--json-output", "--target", server.address],
            tmp_path,
            env,
        )
        # A short sweep from the installed `sluice perf`, against the installed server.
        out = tmp_path / "sweep"
        sweep = ["-c", "2", "-n", "40", "--warmup", "0", "--quiet", "--out", str(out)]
        run([sluice, "perf", "--target", server.address, *sweep], tmp_path, env)
    assert json.loads(answer)["outputs"]["label"]["data"] == [3]
    (level,) = json.loads(out.with_suffix(".json").read_text())["levels"]
    assert level["calls"] == level["ok"] == 40, level["statuses"]
    helped = run([sluice, "perf", "--help"], tmp_path, env)
    assert "--out" in helped and "sluice[perf]" in helped


def runtimes(requires: list[Requirement], extra: str, platform: dict[str, str]) -> set[str]:
    """The ONNX Runtime builds `pip install sluice[extra]` asks for on that platform."""
    environment = {**platform, "extra": extra}
    return {
        r.name
        for r in requires
        if r.name in RUNTIMES and (r.marker is None or r.marker.evaluate(environment))
    }


def test_each_onnx_runtime_build_comes_only_with_its_own_extra(build: Path) -> None:
    with zipfile.ZipFile(build) as wheel:
        (path,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = HeaderParser().parsestr(wheel.read(path).decode())
    requires = [Requirement(line) for line in metadata.get_all("Requires-Dist", [])]
    extras = metadata.get_all("Provides-Extra", [])
    assert {"cpu", "gpu", "dev"} <= set(extras), extras
    for platform in PLATFORMS:
        for extra in ["", *extras]:
            wanted = {name for name, its in RUNTIMES.items() if its == extra}
            if platform["sys_platform"] != "linux":
                wanted.discard("onnxruntime-gpu")  # built for Linux x86_64 (and Windows)
            found = runtimes(requires, extra, platform)
            assert found == wanted, f"sluice[{extra}] on {platform['sys_platform']}: {found}"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of its own, as a user makes one: nothing from this one's site-packages."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    return venv


def pip_install(venv: Path, requirement: str) -> None:
    """From the package index (pip's cache makes a second run quick)."""
    done = subprocess.run(
        [venv / "bin" / "python", *PIP[1:], "install", "--only-binary", ":all:", requirement],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"pip install {requirement} failed:\n{done.stderr}"


def test_a_fresh_venv_gets_the_client_alone_then_one_onnx_runtime_with_cpu(
    build: Path, fresh: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    python = str(fresh / "bin" / "python")
    pip_install(fresh, str(build))
    assert run([python, "-c", ONE_RUNTIME], tmp_path, env).strip() == "[]"
    run([python, "-c", "from sluice import SluiceClient, AsyncSluiceClient"], tmp_path, env)
    # The server without a runtime: one line that says what to install, not a traceback.
    server = [str(fresh / "bin" / "sluice-server"), "--port", "0", "--device", "cpu"]
    done = subprocess.run(server, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    assert "sluice[cpu]" in line and "sluice[gpu]" in line, line
    pip_install(fresh, f"{build}[cpu]")
    assert run([python, "-c", ONE_RUNTIME], tmp_path, env).strip() == "['onnxruntime']"
    predict = [str(fresh / "bin" / "sluice"), "predict", "--sample", "3", "--json-output"]
    with serving([*server, "--node-id", "fresh"], env) as served:
        answer = run([*predict, "--target", served.address], tmp_path, env)
    assert json.loads(answer)["outputs"]["label"]["data"] == [3]


def test_the_images_health_check_passes_while_serving_and_fails_once_draining(
    installed: Path, tmp_path: Path
) -> None:
    """The Dockerfile's HEALTHCHECK command, with the installed wheel as the image has it."""
    argv = [sys.executable, *healthcheck(IMAGE)[1:]]
    server_argv = [str(installed / "bin" / "sluice-server"), "--port", "0", "--device", "cpu"]
    # A long drain delay: the server answers NOT_SERVING, still listening, until it is killed.
    server_argv += ["--node-id", "healthcheck", "--drain-delay-s", "60"]
    with serving(server_argv, elsewhere(installed)) as server:
        env = {**elsewhere(installed), "SLUICE_PORT": server.address.rpartition(":")[2]}
        run(argv, tmp_path, env)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while True:  # one check per second at most, for 60 s: a drain is reported at once
            done = subprocess.run(
                argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
            )
            if done.returncode != 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert server.proc.poll() is None, "the server left before its drain delay"
        server.kill()
    # NOT_SERVING itself (exit status 1, nothing said), not a failed connection.
    assert (done.returncode, done.stderr) == (1, ""), done.stderr
