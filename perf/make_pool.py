"""Write the cheapest model that takes an image as ONNX: FP32 input [N, 3, image, image],
output `output` FP32 [N, 3], each channel's mean (a global average pool). Its server p50
minus its own run time is the per-call cost of the server itself with a 602 KB input.

  python -m perf.make_pool --image 224 --out pool224.onnx
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from perf.make_mlp import cache_path, finish, require_onnx


def build(image: int = 224) -> bytes:
    require_onnx("averaging model")
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["output"]),
        ],
        "pool",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, image, image])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 3])],
    )
    return finish(graph)


def cached(image: int = 224) -> Path:
    """The model's file in the user's cache folder, written on first use."""
    return cache_path(f"pool{image}.onnx", lambda: build(image))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.make_pool", description=__doc__)
    parser.add_argument("--image", type=int, default=224, help="input height and width")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(build(args.image))
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
