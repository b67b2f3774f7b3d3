"""Without ONNX Runtime (`pip install sluice` is the client alone), the server's commands end
with one line that names the extras to install and status 1, no traceback; importing the
engine raises ImportError with those words, so a test, a benchmark or a library user that
imports it decides what to do instead of having its process exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture
def no_runtime(tmp_path: Path) -> dict[str, str]:
    """An environment whose first `onnxruntime` on the path fails to import as a missing one
    does: ModuleNotFoundError naming it (what Python raises when it is not installed), while
    the real one stays installed for the other tests."""
    package = tmp_path / "onnxruntime"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'onnxruntime'\", name='onnxruntime')\n"
    )
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def python(code: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *code], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    "start",
    [
        ["-c", "from sluice.entry import server; server()"],  # the installed `sluice-server`
        ["-m", "sluice.server.main"],  # how its workers start
    ],
    ids=["sluice-server", "python -m sluice.server.main"],
)
def test_the_server_without_a_runtime_says_what_to_install_in_one_line(
    start: list[str], no_runtime: dict[str, str]
) -> None:
    done = python([*start, "--port", "0", "--device", "cpu"], no_runtime)
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    assert line == (
        "sluice-server: ONNX Runtime is not installed: "
        "pip install 'sluice[cpu]' (or 'sluice[gpu]' for NVIDIA GPUs)"
    )
    assert done.stdout == ""


def test_importing_the_engine_without_a_runtime_raises_import_error(
    no_runtime: dict[str, str],
) -> None:
    caught = (
        "try:\n"
        "    import sluice.server.dataplane.engine\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc.name, exc, sep='|')\n"
    )
    done = python(["-c", caught], no_runtime)
    assert done.returncode == 0, done.stderr  # caught: the process goes on
    assert done.stdout.strip().split("|") == [
        "ImportError",
        "onnxruntime",
        "sluice-server: ONNX Runtime is not installed: "
        "pip install 'sluice[cpu]' (or 'sluice[gpu]' for NVIDIA GPUs)",
    ]
