"""Write a ResNet-50 (v1.5) image classifier as ONNX for GPU benchmarks: FP32 input
[N, 3, image, image], output `output` FP32 [N, 1000] logits. Seeded random weights, with
BatchNorm folded into the convolutions' biases as exported inference models have it.

  python -m perf.make_resnet --image 224 --out resnet50.onnx
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from perf.make_mlp import cache_path, require_onnx

STAGES = ((64, 3), (128, 4), (256, 6), (512, 3))  # (bottleneck width, blocks) per stage
EXPANSION = 4
BRANCH_SCALE = 0.2  # on each residual branch's last conv: keeps 16 unnormalized adds finite
BIAS_STD = 0.01


def build(image: int = 224, classes: int = 1000, seed: int = 0) -> bytes:
    onnx = require_onnx("ResNet")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    initializers: list[Any] = []

    def weights(name: str, shape: tuple[int, ...], std: float) -> str:
        array = rng.standard_normal(shape, dtype=np.float32)
        array *= np.float32(std)
        initializers.append(numpy_helper.from_array(array, name))
        return name

    def conv(
        name: str,
        source: str,
        channels: int,
        out: int,
        kernel: int,
        stride: int = 1,
        relu: bool = True,
        scale: float = 1.0,
    ) -> str:
        """Conv (+ folded BatchNorm as its bias), then ReLU unless `relu` is False.
        He-normal: std sqrt(2 / fan_in) before a ReLU, sqrt(1 / fan_in) before an Add."""
        fan_in = channels * kernel * kernel
        std = scale * np.sqrt((2.0 if relu else 1.0) / fan_in)
        w = weights(f"{name}.weight", (out, channels, kernel, kernel), std)
        b = weights(f"{name}.bias", (out,), BIAS_STD)
        pad = kernel // 2
        nodes.append(
            helper.make_node(
                "Conv",
                [source, w, b],
                [f"{name}.out" if relu else name],
                name=name,
                kernel_shape=[kernel, kernel],
                strides=[stride, stride],
                pads=[pad] * 4,
            )
        )
        if not relu:
            return name
        nodes.append(helper.make_node("Relu", [f"{name}.out"], [f"{name}.relu"]))
        return f"{name}.relu"

    x = conv("conv1", "input", 3, 64, 7, stride=2)
    nodes.append(
        helper.make_node(
            "MaxPool", [x], ["maxpool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
        )
    )
    x, channels = "maxpool", 64
    for stage, (width, blocks) in enumerate(STAGES, start=1):
        out = width * EXPANSION
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            stride = 2 if block == 0 and stage > 1 else 1  # v1.5: the stride is on the 3x3
            h = conv(f"{prefix}.conv1", x, channels, width, 1)
            h = conv(f"{prefix}.conv2", h, width, width, 3, stride=stride)
            h = conv(f"{prefix}.conv3", h, width, out, 1, relu=False, scale=BRANCH_SCALE)
            shortcut = x
            if block == 0:
                shortcut = conv(
                    f"{prefix}.downsample", x, channels, out, 1, stride=stride, relu=False
                )
            nodes.append(helper.make_node("Add", [h, shortcut], [f"{prefix}.add"]))
            nodes.append(helper.make_node("Relu", [f"{prefix}.add"], [f"{prefix}.relu"]))
            x, channels = f"{prefix}.relu", out
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["avgpool"]))
    nodes.append(helper.make_node("Flatten", ["avgpool"], ["flatten"], axis=1))
    fc_w = weights("fc.weight", (classes, channels), float(np.sqrt(1.0 / channels)))
    fc_b = weights("fc.bias", (classes,), BIAS_STD)
    nodes.append(helper.make_node("Gemm", ["flatten", fc_w, fc_b], ["output"], transB=1))

    graph = helper.make_graph(
        nodes,
        f"resnet50_{image}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, image, image])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", classes])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.graph.initializer.extend(initializers)  # after make_model, which copies its graph
    model.ir_version = 8
    data = bytes(model.SerializeToString())  # ~100 MB: serialized once, for both uses
    onnx.checker.check_model(data)
    return data


def cached(image: int = 224) -> Path:
    """The ResNet's file in the user's cache folder, written on first use (it is ~100 MB at
    fp32)."""
    return cache_path(f"resnet50_{image}.onnx", lambda: build(image))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.make_resnet", description=__doc__)
    parser.add_argument("--image", type=int, default=224, help="input height and width")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(build(args.image))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
