"""What both tiers share: the bundled samples and ONNX Runtime called directly, the truth
the server must match. No process harness here: the unit tier starts nothing."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from sluice import models

SAMPLES = models.samples()


@pytest.fixture(scope="session")
def reference() -> ort.InferenceSession:
    return ort.InferenceSession(str(models.DIGITS), providers=["CPUExecutionProvider"])
