"""Plain inputs against a real server: nested lists from Python, NAME=JSON from the shell
(converted to the input's datatype from the model's metadata), JSON output by
--json-output, and values that cannot be converted named with the input and the datatype
wanted, before anything is sent."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import onnxruntime as ort
import pytest

from sluice.client import SluiceClient
from tests.conftest import SAMPLES
from tests.e2e.harness import BIN, Process

pytestmark = pytest.mark.e2e

SAMPLE = SAMPLES[3]  # FP32 [1, 64], whole numbers: the README's example digit


def sluice(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "sluice"), *argv], capture_output=True, text=True, timeout=60)


def test_the_python_client_takes_nested_lists_and_tuples(
    server: Process, reference: ort.InferenceSession
) -> None:
    (want,) = reference.run(["label"], {"input": SAMPLE.input})
    rows = SAMPLE.input.tolist()
    with SluiceClient(server.address) as client:
        for plain in (rows, tuple(tuple(row) for row in rows)):
            got = client.predict({"input": plain}, outputs=["label"])
            np.testing.assert_array_equal(got["label"], want)


def test_json_input_takes_the_models_datatype_and_json_output_is_json(server: Process) -> None:
    whole = json.dumps([[int(v) for v in SAMPLE.input.ravel()]])  # ints, as a user types them
    done = sluice("predict", "--target", server.address, "--json-output", f"input={whole}")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["outputs"]["label"] == {"datatype": "INT64", "shape": [1], "data": [3]}


def test_health_and_metadata_print_json_on_request(server: Process) -> None:
    health = sluice("health", "--target", server.address, "--json-output")
    assert health.returncode == 0, health.stderr
    assert len(health.stdout.splitlines()) == 1
    assert json.loads(health.stdout)["node_id"] == "test-node"
    meta = sluice("metadata", "--target", server.address, "--json-output")
    assert meta.returncode == 0, meta.stderr
    assert json.loads(meta.stdout)["model"]["inputs"][0]["datatype"] == "FP32"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('[["a", 1]]', "it holds strings"),
        ("[[1, 2], [3]]", "its nested lists differ in length"),
        ("[[1, null]]", "it holds None"),
        ("[[1e39]]", "it holds finite values outside the range of FP32"),
    ],
)
def test_a_value_that_does_not_convert_names_the_input_and_datatype(
    server: Process, value: str, reason: str
) -> None:
    done = sluice("predict", "--target", server.address, f"input={value}")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: sluice predict"), done.stderr
    assert f"sluice predict: error: input 'input' cannot be converted to FP32: {reason}" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr
