from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import pytest

from tests.procs import MODEL, ROOT, Process, running_server


@dataclass(frozen=True)
class Sample:
    label: int
    path: str
    input: np.ndarray  # FP32 [1, 64]


def load_samples() -> list[Sample]:
    folder = ROOT / "models" / "samples"
    records = json.loads((folder / "samples.json").read_text())
    return [
        Sample(r["label"], str(folder / r["file"]), np.load(folder / r["file"])) for r in records
    ]


SAMPLES = load_samples()


@pytest.fixture(scope="session")
def reference() -> ort.InferenceSession:
    """ONNX Runtime called directly: the truth the server must match."""
    return ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with running_server("--max-message-bytes", str(1024 * 1024)) as proc:
        yield proc
