"""A request's check against its model finds NaN and infinity without a temporary the size of
the input: it runs on every call, and a 602 KB image's 150 KB of flags cost fresh memory."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest

from sluice import models
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import Model, holds_nonfinite

FLOATS = (np.float16, np.float32, np.float64)
INTS = (np.int8, np.uint8, np.int32, np.int64, np.uint64, np.bool_)


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    engine = Engine(models.DIGITS, device="cpu")
    yield Model(engine, Batcher(engine.instances, max_rows=1, budget_s=0.0, max_queue=8))
    engine.close()


def image() -> np.ndarray:
    """602 KB of FP32, as a 224 x 224 RGB image is, in the digits model's rows of 64."""
    return np.random.default_rng(0).standard_normal((3 * 224 * 224 // 64, 64), dtype=np.float32)


def test_the_check_of_a_602_kb_input_allocates_nothing_of_its_size(model: Model) -> None:
    inputs = {"input": image()}
    assert inputs["input"].nbytes == 602_112
    model.check(inputs)  # anything made once, made now
    tracemalloc.start()
    try:
        assert model.check(inputs) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4096  # np.isfinite's flags took 150 KB


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("at", [0, 1000, -1])
def test_nan_and_infinity_anywhere_are_told(model: Model, bad: float, at: int) -> None:
    array = image()
    array.reshape(-1)[at] = bad
    assert model.check({"input": array}) == ["input"]


def cases() -> Iterator[np.ndarray]:
    rng = np.random.default_rng(1)
    for dtype in FLOATS:
        info = np.finfo(dtype)
        yield rng.standard_normal(37).astype(dtype)
        yield np.array([info.max, info.min, info.tiny, -info.tiny, 0.0, -0.0], dtype)
        for bad in (np.nan, np.inf, -np.inf):
            for at in (0, 18, 36):
                array = rng.standard_normal(37).astype(dtype)
                array[at] = bad
                yield array
        yield np.array([np.inf, -np.inf], dtype)
        yield np.array([np.nan, np.inf, -np.inf], dtype)
        yield np.array([], dtype)
        yield np.array(np.nan, dtype)  # a scalar
        yield np.full((4, 5), np.inf, dtype)[:, ::2]  # not contiguous
    for dtype in INTS:
        yield (np.arange(12) % 2).astype(dtype).reshape(3, 4)
        yield np.array([], dtype)


@pytest.mark.parametrize("array", list(cases()), ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_the_same_answer_as_isfinite(array: np.ndarray) -> None:
    expected = array.dtype.kind == "f" and not bool(np.isfinite(array).all())
    assert holds_nonfinite(array) is expected
