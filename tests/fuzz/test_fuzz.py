"""The fuzz targets, each a bounded, seeded libFuzzer run in a process of its own: no crash,
no hang, no disagreement with protobuf's parser. The long runs are in docs/FUZZING.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Inputs a run: a few seconds of a target on a busy core. A count, not a time, so that the
# verdict is the same on a slow machine as on a fast one.
RUNS = 20_000
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target", ["predict", "facts"])
def test_a_bounded_run_finds_nothing(target: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    argv = [
        sys.executable,
        "-m",
        f"tests.fuzz.{target}",
        f"-runs={RUNS}",
        "-seed=1",
        "-timeout=10",  # seconds for one input: a hang
        f"-artifact_prefix={tmp_path}/",
        str(corpus),
    ]
    # Python's string hashing is seeded too: one order of sets and dicts, one run.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout
    # What it found first, then libFuzzer's last lines (which name the input).
    found = [line for line in out.splitlines() if line.startswith(("Disagreement:", "=="))]
    tail = "\n".join([*found[:2], out[-3000:]])
    assert done.returncode == 0, tail
    assert f"Done {RUNS} runs" in out, tail
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*")), tail
