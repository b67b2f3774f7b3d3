"""Write a compute-heavy MLP as ONNX for benchmarks: FP32 input [N, inputs], `depth` hidden
layers of `width` with ReLU, output `output` FP32 [N, outputs]. Seeded random weights.

  python -m perf.make_mlp --width 4096 --depth 2 --out mlp4096.onnx
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def require_onnx(what: str) -> Any:
    """The onnx package, or SystemExit saying how to get it: only the benchmark models
    need it, so it is in the perf extra."""
    try:
        import onnx
    except ImportError as exc:
        raise SystemExit(
            f"the benchmark {what} is written with onnx, which is not installed ({exc}); "
            "pip install 'sluice[perf]'"
        ) from exc
    return onnx


def finish(graph: Any) -> bytes:
    """The graph as a checked model's bytes, at the opset and IR version every benchmark model
    uses (what the pinned ONNX Runtime builds all load)."""
    onnx = require_onnx("model")
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def cache_path(filename: str, build: Callable[[], bytes]) -> Path:
    """`filename` in the user's cache folder, built on first use (the benchmark models are
    generated, never committed)."""
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice"
    path = folder / filename
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(build())
        partial.replace(path)  # whole or absent, even with two benchmarks starting at once
    return path


def build(width: int, depth: int, inputs: int = 64, outputs: int = 10, seed: int = 0) -> bytes:
    require_onnx("MLP")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, initializers = [], []
    previous, size = "input", inputs
    for i, out in enumerate([width] * depth + [outputs]):
        w = (rng.standard_normal((size, out)) / np.sqrt(size)).astype(np.float32)
        b = np.zeros(out, np.float32)
        initializers += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == depth
        name = "output" if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [previous, f"w{i}", f"b{i}"], [f"{name}_pre"]))
        nodes.append(helper.make_node("Identity" if last else "Relu", [f"{name}_pre"], [name]))
        previous, size = name, out
    graph = helper.make_graph(
        nodes,
        f"mlp{width}x{depth}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", inputs])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", outputs])],
        initializers,
    )
    return finish(graph)


def cached(width: int = 4096, depth: int = 2) -> Path:
    """The MLP's file in the user's cache folder, written on first use (it is ~130 MB at
    4096 wide)."""
    return cache_path(f"mlp{width}x{depth}.onnx", lambda: build(width, depth))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.make_mlp", description=__doc__)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(build(args.width, args.depth))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
