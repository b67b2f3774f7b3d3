"""The bundled digits model and its labelled samples, as package data (made by
`python -m perf.make_digits`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FOLDER = Path(__file__).resolve().parent
DIGITS = FOLDER / "digits.onnx"
SAMPLES = FOLDER / "samples"


@dataclass(frozen=True)
class Sample:
    label: int
    path: Path
    input: np.ndarray  # FP32 [1, 64]


def samples() -> list[Sample]:
    """The ten labelled samples, digit 0 to 9."""
    records = json.loads((SAMPLES / "samples.json").read_text())
    return [Sample(r["label"], SAMPLES / r["file"], np.load(SAMPLES / r["file"])) for r in records]
