"""The benchmark models' shared helpers: the cache file written once, whole, and a graph
finished into a checked model's bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from perf import make_mlp


def test_a_cached_model_is_built_once_and_left_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    builds: list[int] = []

    def build() -> bytes:
        builds.append(1)
        return b"model"

    path = make_mlp.cache_path("m0.5_8.onnx", build)
    assert path == tmp_path / "sluice" / "m0.5_8.onnx" and path.read_bytes() == b"model"
    assert make_mlp.cache_path("m0.5_8.onnx", build) == path and len(builds) == 1
    assert [p.name for p in path.parent.iterdir()] == ["m0.5_8.onnx"]  # no partial left


def test_a_finished_graph_runs() -> None:
    session = ort.InferenceSession(make_mlp.build(8, 1), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"input": np.ones((2, 64), np.float32)})
    assert out.shape == (2, 10)
