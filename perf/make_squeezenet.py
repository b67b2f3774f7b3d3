"""Write a SqueezeNet 1.1 image classifier as ONNX for benchmarks of large inputs: FP32 input
[N, 3, image, image] (602 KB a row at 224), output `output` FP32 [N, 1000]. At half its
channels (the default) a convnet that runs in about 2 ms on two CPU cores, so the cost of
carrying its input shows (ResNet-50's compute hides it). Seeded He-initialised weights.

  python -m perf.make_squeezenet --out squeezenet.onnx
  python -m perf.make_squeezenet --width 1 --out squeezenet11.onnx   # SqueezeNet 1.1 itself
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from perf.make_mlp import cache_path, finish, require_onnx

# (squeeze, 1x1 expand, 3x3 expand) channels of each Fire module, by stage; a max pool
# comes before each stage
STAGES = (
    ((16, 64, 64), (16, 64, 64)),
    ((32, 128, 128), (32, 128, 128)),
    ((48, 192, 192), (48, 192, 192), (64, 256, 256), (64, 256, 256)),
)
# Every channel count (conv1's 64 and the Fires') times this, the classifier's 1000 excepted:
# at 224, two threads of ONNX Runtime alone on the 2-core benchmark CPU take ~4 ms at
# SqueezeNet 1.1's own widths (1.0), and 1.6-2 ms at half of them, where the cost of carrying
# the input shows.
WIDTH = 0.5
BIAS_STD = 0.01


def build(image: int = 224, classes: int = 1000, seed: int = 0, width: float = WIDTH) -> bytes:
    require_onnx("SqueezeNet")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    initializers: list[Any] = []

    def weights(name: str, shape: tuple[int, ...], std: float) -> str:
        array = rng.standard_normal(shape, dtype=np.float32)
        array *= np.float32(std)
        initializers.append(numpy_helper.from_array(array, name))
        return name

    def conv(name: str, source: str, channels: int, out: int, kernel: int, **attrs: Any) -> str:
        """Conv then ReLU (every conv here has one). He-normal: std sqrt(2 / fan_in)."""
        std = float(np.sqrt(2.0 / (channels * kernel * kernel)))
        w = weights(f"{name}.weight", (out, channels, kernel, kernel), std)
        b = weights(f"{name}.bias", (out,), BIAS_STD)
        nodes.append(
            helper.make_node(
                "Conv",
                [source, w, b],
                [f"{name}.out"],
                name=name,
                kernel_shape=[kernel] * 2,
                **attrs,
            )
        )
        nodes.append(helper.make_node("Relu", [f"{name}.out"], [f"{name}.relu"]))
        return f"{name}.relu"

    def maxpool(name: str, source: str) -> str:
        # ceil_mode as torchvision's: 111 -> 55 -> 27 -> 13 at 224
        nodes.append(
            helper.make_node(
                "MaxPool", [source], [name], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1
            )
        )
        return name

    def w(channels: int) -> int:
        return max(8, round(channels * width / 8) * 8)  # whole multiples of 8, as slim nets do

    x, channels = conv("conv1", "input", 3, w(64), 3, strides=[2, 2]), w(64)
    number = 2  # the paper's names: fire2 ... fire9
    for stage, fires in enumerate(STAGES, start=1):
        x = maxpool(f"pool{stage}", x)
        for squeeze, e1, e3 in ((w(a), w(b), w(c)) for a, b, c in fires):
            prefix = f"fire{number}"
            s = conv(f"{prefix}.squeeze", x, channels, squeeze, 1)
            left = conv(f"{prefix}.expand1x1", s, squeeze, e1, 1)
            right = conv(f"{prefix}.expand3x3", s, squeeze, e3, 3, pads=[1] * 4)
            nodes.append(helper.make_node("Concat", [left, right], [f"{prefix}.concat"], axis=1))
            x, channels, number = f"{prefix}.concat", e1 + e3, number + 1
    x = conv("conv10", x, channels, classes, 1)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["avgpool"]))
    nodes.append(helper.make_node("Flatten", ["avgpool"], ["output"], axis=1))

    graph = helper.make_graph(
        nodes,
        f"squeezenet11x{width:g}_{image}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, image, image])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", classes])],
        initializers,
    )
    return finish(graph)


def cached(image: int = 224, width: float = WIDTH) -> Path:
    """The SqueezeNet's file in the user's cache folder, written on first use (1.8 MB at the
    default width, 5 MB at 1)."""
    return cache_path(f"squeezenet11x{width:g}_{image}.onnx", lambda: build(image, width=width))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.make_squeezenet", description=__doc__)
    parser.add_argument("--image", type=int, default=224, help="input height and width")
    parser.add_argument(
        "--width", type=float, default=WIDTH, help="channels as a fraction of SqueezeNet 1.1's"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(build(args.image, seed=args.seed, width=args.width))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
