"""Triton's own client and its shared memory utilities (`tritonclient[grpc]`, unmodified)
against a real sluice-server started with --shared-memory: regions registered and listed,
an inference with its input and outputs in them equal to ONNX Runtime's answers, Triton's
refusals, unregistering, the sweep of an object its caller unlinked; and the server without
the option. The client runs in its own venv (tests/e2e/test_tritonclient_e2e.py), through
tests/e2e/tritonclient_shm_check.py."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from sluice.shm.setup import ONE_PROCESS
from tests.conftest import SAMPLES
from tests.e2e.harness import Process, running_server, server_argv
from tests.e2e.test_tritonclient_e2e import tritonclient_python

pytestmark = pytest.mark.e2e

CHECK = Path(__file__).with_name("tritonclient_shm_check.py")
X = np.concatenate([s.input for s in SAMPLES[:4]])
INVALID = "StatusCode.INVALID_ARGUMENT"


@pytest.fixture(scope="module")
def triton_python() -> Path:
    return tritonclient_python()


@pytest.fixture(scope="module")
def shared_server() -> Iterator[Process]:
    with running_server("--shared-memory") as proc:
        yield proc


def run_check(python: Path, address: str, mode: str, tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "input.npy"
    np.save(path, X)
    prefix = f"/sluice-tritonclient-{uuid.uuid4().hex}"
    try:
        out = subprocess.run(
            [python, str(CHECK), address, "digits", str(path), mode, prefix],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    finally:  # a check killed by the timeout never reached its own clean-up
        for left in Path("/dev/shm").glob(f"{prefix[1:]}-*"):
            left.unlink(missing_ok=True)
    assert out.returncode == 0, out.stderr
    found: dict[str, Any] = json.loads(out.stdout)
    return found


def test_tritonclient_shared_memory(
    shared_server: Process,
    triton_python: Path,
    reference: ort.InferenceSession,
    tmp_path: Path,
) -> None:
    found = run_check(triton_python, shared_server.address, "on", tmp_path)
    label, probabilities = reference.run(None, {"input": X})

    regions = found["registered"]["regions"]
    assert sorted(regions) == ["input_data", "output_data"]
    assert regions["input_data"]["byte_size"] == str(X.nbytes)  # uint64: a string in JSON
    assert regions["input_data"]["key"].endswith("-input_data")
    assert regions["output_data"]["byte_size"] == str(4 * 8 + 4 * 10 * 4)

    answer = found["answer"]
    assert answer["id"] == "s"
    assert answer["outputs"] == {
        "label": {
            "datatype": "INT64",
            "shape": [4],
            "parameters": {"shared_memory_region": "output_data", "shared_memory_byte_size": 32},
            "raw": 0,
        },
        "probabilities": {
            "datatype": "FP32",
            "shape": [4, 10],
            "parameters": {
                "shared_memory_region": "output_data",
                "shared_memory_byte_size": 160,
                "shared_memory_offset": 32,
            },
            "raw": 0,
        },
    }
    np.testing.assert_array_equal(np.array(answer["label"], np.int64), label)
    np.testing.assert_array_equal(np.array(answer["probabilities"], np.float32), probabilities)
    for mixed in found["mixed"].values():
        np.testing.assert_array_equal(np.array(mixed["label"], np.int64), label)
        np.testing.assert_array_equal(np.array(mixed["probabilities"], np.float32), probabilities)

    errors = found["errors"]
    assert errors["unknown_region"] == {
        "status": INVALID,
        "message": "Unable to find shared memory region: 'no_such_region'",
    }
    assert errors["size_mismatch"]["status"] == INVALID
    assert errors["size_mismatch"]["message"].startswith(
        "input byte size mismatch for input 'input' for model 'digits'. Expected 1024, got 1020"
    )
    assert errors["bad_key"]["status"] == INVALID
    assert "must be a POSIX shared memory name" in errors["bad_key"]["message"]
    assert errors["missing_key"]["status"] == INVALID
    assert errors["missing_key"]["message"].startswith("Unable to open shared memory region")
    assert errors["past_the_end"]["status"] == INVALID
    assert "is past the end" in errors["past_the_end"]["message"]
    assert errors["taken"] == {
        "status": "StatusCode.ALREADY_EXISTS",
        "message": "shared memory region 'input_data' already in manager",
    }
    assert errors["unknown_status"] == {
        "status": "StatusCode.NOT_FOUND",
        "message": "Unable to find system shared memory region: 'nope'",
    }
    assert errors["cuda_register"]["status"] == INVALID
    assert "GPUs not supported" in errors["cuda_register"]["message"]
    assert errors["unregistered"] == {
        "status": INVALID,
        "message": "Unable to find shared memory region: 'input_data'",
    }
    assert found["unregistered"] == {}
    assert found["swept"] is True  # listed, then swept once its caller unlinked it
    assert found["cuda_status"] == {}


def test_tritonclient_without_shared_memory(
    server: Process, triton_python: Path, tmp_path: Path
) -> None:
    found = run_check(triton_python, server.address, "off", tmp_path)
    off = "shared memory is off; start sluice-server with --shared-memory"
    for call in ("register", "status", "unregister"):
        assert found[call]["status"] == "StatusCode.UNIMPLEMENTED"
        assert found[call]["message"].startswith(off)
    assert found["infer"]["status"] == INVALID
    assert found["infer"]["message"].startswith(
        "input 'input' names a shared memory region; Sluice does not serve shared memory here: "
        "start sluice-server with --shared-memory"
    )
    assert found["extensions"] == []


def test_shared_memory_takes_one_process() -> None:
    out = subprocess.run(
        server_argv("--shared-memory", "--workers", "2"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert ONE_PROCESS in out.stderr
