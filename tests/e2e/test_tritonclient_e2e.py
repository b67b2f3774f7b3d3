"""Triton's own Python client (`tritonclient[grpc]`, unmodified) against a real sluice-server
and a balancer in front of one: health, metadata, inference with raw inputs, the id echo
and the status codes. tritonclient
pins protobuf<7 and Sluice needs protobuf 7, so the client runs in a venv of its own
(.venv-tritonclient at the repository root, made on first use and reused while it imports),
through tests/e2e/tritonclient_check.py; the answers are judged here against ONNX Runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, Process, running

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-tritonclient"
PIN = "tritonclient[grpc]==2.73.0"
CHECK = Path(__file__).with_name("tritonclient_check.py")
PROBE = "import importlib.metadata as m; assert m.version('tritonclient') == '2.73.0'"


def tritonclient_python() -> Path:
    """The venv's python, made (and tritonclient installed from PyPI) unless it is there."""
    python = VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", PROBE], check=False).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True, timeout=300)
    pip = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", PIN],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert pip.returncode == 0, f"pip install {PIN} failed:\n{pip.stdout}\n{pip.stderr}"
    return python


@pytest.fixture(scope="session")
def triton_python() -> Path:
    return tritonclient_python()


def run_check(python: Path, address: str, x: np.ndarray, tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "input.npy"
    np.save(path, x)
    out = subprocess.run(
        [python, str(CHECK), address, "digits", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    found: dict[str, Any] = json.loads(out.stdout)
    return found


def test_tritonclient_against_a_server(
    server: Process, triton_python: Path, reference: ort.InferenceSession, tmp_path: Path
) -> None:
    x = np.concatenate([s.input for s in SAMPLES[:4]])
    found = run_check(triton_python, server.address, x, tmp_path)

    assert (found["live"], found["ready"]) == (True, True)
    assert (found["model_ready"], found["unknown_model_ready"]) == (True, False)
    assert found["server_metadata"]["name"] == "sluice"
    assert found["server_metadata"].get("extensions", []) == []
    meta = found["model_metadata"]
    assert (meta["name"], meta["versions"], meta["platform"]) == (
        "digits",
        ["1"],
        "onnxruntime_onnx",
    )
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("input", "FP32", ["-1", "64"])  # int64 is a string in protobuf's JSON
    ]
    assert [t["name"] for t in meta["outputs"]] == ["label", "probabilities"]

    label, probabilities = reference.run(None, {"input": x})
    answers = found["answers"]
    assert [answers[k]["id"] for k in ("first", "second", "none")] == ["first", "second", ""]
    for answer in answers.values():
        assert (answer["model_name"], answer["model_version"]) == ("digits", "1")
        outputs = answer["outputs"]
        assert (outputs["label"]["datatype"], outputs["label"]["shape"]) == ("INT64", [4])
        assert outputs["probabilities"]["shape"] == [4, 10]
        np.testing.assert_array_equal(np.array(outputs["label"]["data"], np.int64), label)
        got = np.array(outputs["probabilities"]["data"], outputs["probabilities"]["dtype"])
        np.testing.assert_array_equal(got, probabilities)
    assert found["subset"] == ["label"]

    errors = found["errors"]
    assert errors["unknown_model"]["status"] == "StatusCode.NOT_FOUND"
    assert "unknown model 'no-such-model'" in errors["unknown_model"]["message"]
    assert errors["wrong_shape"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "size 63 in dimension 1" in errors["wrong_shape"]["message"]
    assert errors["model_metadata"]["status"] == "StatusCode.NOT_FOUND"
    assert errors["repository_index"]["status"] == "StatusCode.UNIMPLEMENTED"
    assert "--repository-api" in errors["repository_index"]["message"]


def test_tritonclient_against_a_balancer(
    server: Process, triton_python: Path, reference: ort.InferenceSession, tmp_path: Path
) -> None:
    x = np.concatenate([s.input for s in SAMPLES[4:8]])
    balancer_argv = [str(BIN / "sluice-balancer"), "--port", "0", "--backend", server.address]
    with running(balancer_argv) as balancer:
        found = run_check(triton_python, balancer.address, x, tmp_path)
    assert (found["live"], found["ready"]) == (True, True)
    assert (found["model_ready"], found["unknown_model_ready"]) == (True, False)
    assert found["server_metadata"]["name"] == "sluice-balancer"
    assert found["model_metadata"]["name"] == "digits"
    label, probabilities = reference.run(None, {"input": x})
    for answer in found["answers"].values():
        assert (answer["model_name"], answer["model_version"]) == ("digits", "1")
        outputs = answer["outputs"]
        np.testing.assert_array_equal(np.array(outputs["label"]["data"], np.int64), label)
        got = np.array(outputs["probabilities"]["data"], outputs["probabilities"]["dtype"])
        np.testing.assert_array_equal(got, probabilities)
    errors = found["errors"]
    assert errors["unknown_model"]["status"] == "StatusCode.NOT_FOUND"
    assert (
        "no server behind this balancer serves model 'no-such-model'"
        in (errors["unknown_model"]["message"])
    )
    assert errors["wrong_shape"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert errors["repository_index"]["status"] == "StatusCode.UNIMPLEMENTED"
