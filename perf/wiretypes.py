"""What compact wire types buy: a uint8 image sent to an FP32 model (the SqueezeNet of
perf/make_squeezenet.py, [1, 3, 224, 224]) that takes UINT8 on the wire, against the same
values sent as FP32, side by side in one run.

  python -m perf.wiretypes --rounds 3 --duration 3s --out wiretypes.json

One server (CPU, cache off, so every call runs the model) serving a repository: the
SqueezeNet taking UINT8 and FP16 as they are, and a second copy taking UINT8 * 1/255.
First the answers: UINT8 and FP16 must equal FP32's exactly; the 1/255 cast is compared to
the FP32 of x / 255 (within 1e-6 relative), and so are the outputs. Then the serialized
request sizes, and `sluice perf --data FILE.npy -c 1` on each body in rounds that alternate
(the order rotating every round), so drift on a shared machine hits each alike: c=1 p50 and
the server's CPU per call (`sluice perf`'s target_cpu), medians over rounds, and the ratios
to FP32's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from perf import make_squeezenet, paired
from perf.launch import running, server_argv
from sluice.perf.sweep import request_body
from sluice.server.dataplane import staging
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec

IMAGE = (1, 3, 224, 224)
BY_255 = 1 / 255
MODEL, SCALED = "squeezenet", "squeezenet255"
# The bodies swept, by the datatype they carry; FP32 is what the others are judged against.
BODIES = ("FP32", "UINT8", "FP16")


def repository(root: Path, model: Path) -> None:
    """The two served copies of the model, each with its wire types in its config.pbtxt."""
    for name, accepts in ((MODEL, "UINT8, FP16"), (SCALED, f"UINT8*{BY_255!r}")):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(model, root / name / "1" / "model.onnx")
        (root / name / "config.pbtxt").write_text(
            f'parameters {{ key: "sluice.accept.input" value: {{ string_value: "{accepts}" }} }}\n'
        )


def predict(address: str, model: str, x: np.ndarray) -> np.ndarray:
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.InferenceStub(channel).Predict(
            pb.PredictRequest.FromString(codec.encode_predict({"input": x}, model=model)),
            timeout=30,
        )
    out = reply.outputs[0]
    return np.frombuffer(out.raw_data, np.float32).reshape(out.shape)


def relative(got: np.ndarray, want: np.ndarray) -> float:
    """The largest |got - want| / |want| (where want is not 0)."""
    given = want != 0
    return float(np.max(np.abs(got[given] - want[given]) / np.abs(want[given]), initial=0.0))


def normwise(got: np.ndarray, want: np.ndarray) -> float:
    """The largest |got - want| against the largest |want|: for outputs, where a logit
    near 0 makes any elementwise relative difference large."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def answers(address: str, image: np.ndarray) -> dict[str, Any]:
    """Whether each wire type answers as FP32 does, and how far 1/255 is from x / 255."""
    as_fp32 = predict(address, MODEL, image.astype(np.float32))
    by_255 = (image / 255).astype(np.float32)
    how = staging.Cast(np.dtype(np.float32), np.float32(BY_255), np.float32(0))
    scaled_out = predict(address, SCALED, image)
    fp32_out = predict(address, SCALED, by_255)
    return {
        "uint8_equals_fp32": bool(np.array_equal(predict(address, MODEL, image), as_fp32)),
        "fp16_equals_fp32": bool(
            np.array_equal(predict(address, MODEL, image.astype(np.float16)), as_fp32)
        ),
        "cast_1_255_vs_x_255_relative": relative(staging.cast(image, how), by_255),
        "output_1_255_vs_x_255_normwise": normwise(scaled_out, fp32_out),
        "output_1_255_vs_x_255_max_abs": float(np.max(np.abs(scaled_out - fp32_out))),
    }


def sizes(image: np.ndarray, call: str) -> dict[str, int]:
    """Serialized request bytes of each body, as `sluice perf` sends them."""
    dtypes = {"FP32": np.float32, "UINT8": np.uint8, "FP16": np.float16}
    return {n: len(request_body(image.astype(dtypes[n]), "input", call, MODEL)) for n in BODIES}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per body: c=1 p50 (ms) and server CPU per call (ms), medians over rounds; the median
    of each round's ratio to FP32's in that round (drift between rounds cancels); and each
    round's figures for the record."""
    found: dict[str, dict[str, Any]] = {}
    for name, rounds in runs.items():
        levels = [run["levels"][0] for run in rounds]
        cpu = [lv["target_cpu"].get("per_call_ms") for lv in levels]
        found[name] = {
            "p50_ms": statistics.median(lv["latency"]["p50"] for lv in levels),
            "cpu_ms": statistics.median(c for c in cpu if c is not None) if any(cpu) else None,
            "errors": sum(lv["calls"] - lv["ok"] for lv in levels),
            "saturated": any(lv["client_saturated"] for lv in levels),
            "rounds": [
                {"p50_ms": lv["latency"]["p50"], "cpu_ms": c}
                for lv, c in zip(levels, cpu, strict=True)
            ],
        }
    base = found["FP32"]["rounds"]
    for cell in found.values():
        for key in ("p50_ms", "cpu_ms"):
            pairs = [(r[key], b[key]) for r, b in zip(cell["rounds"], base, strict=True)]
            ratios = [a / b for a, b in pairs if a is not None and b]
            cell[f"{key}_paired_ratio"] = statistics.median(ratios) if ratios else None
    return found


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def table(result: dict[str, Any]) -> str:
    sweeps, bytes_ = result["sweeps"], result["request_bytes"]
    lines = [
        "| body | request bytes | c=1 p50 ms | CPU ms/call | bytes vs FP32 | p50 vs FP32 "
        "| CPU vs FP32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in BODIES:
        cell = sweeps[name]
        cpu = "n/a" if cell["cpu_ms"] is None else f"{cell['cpu_ms']:.3f}"
        lines.append(
            f"| {name} | {bytes_[name]:,} | {cell['p50_ms']:.3f} | {cpu} "
            f"| {ratio(bytes_[name], bytes_['FP32'])} | {times(cell['p50_ms_paired_ratio'])} "
            f"| {times(cell['cpu_ms_paired_ratio'])} |"
        )
    checks = result["answers"]
    lines += [
        "",
        "p50 and CPU vs FP32: the median over rounds of each round's ratio to FP32's in that "
        "round; p50 and CPU: medians over rounds",
        f"UINT8 answers equal FP32's: {checks['uint8_equals_fp32']}; "
        f"FP16's: {checks['fp16_equals_fp32']}",
        "UINT8 * 1/255 against the FP32 of x / 255: input "
        f"{checks['cast_1_255_vs_x_255_relative']:.2e} "
        f"relative; outputs {checks['output_1_255_vs_x_255_normwise']:.2e} of the largest, "
        f"{checks['output_1_255_vs_x_255_max_abs']:.2e} absolute",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m perf.wiretypes", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", default="3s", help="per body per round")
    parser.add_argument("--warmup", default="0.5s", help="unrecorded time before each sweep")
    parser.add_argument("--call", choices=["predict", "modelinfer"], default="predict")
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    model = make_squeezenet.cached(IMAGE[2])
    image = np.random.default_rng(0).integers(0, 256, IMAGE, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as temp:
        folder = Path(temp)
        repository(folder / "models", model)
        data = {}
        for name, dtype in (("FP32", np.float32), ("UINT8", np.uint8), ("FP16", np.float16)):
            data[name] = folder / f"{name.lower()}.npy"
            np.save(data[name], image.astype(dtype))
        argv_ = server_argv(
            *("--device", "cpu", "--cache-entries", "0"),
            *("--model-repository", str(folder / "models")),
            node_id="wiretypes",
        )
        with running(argv_, start_s=120.0) as server:
            checks = answers(server.address, image)
            common = ["--call", args.call, "-c", "1", "-z", args.duration, "--warmup", args.warmup]
            common += ["--model", MODEL]
            configs = {n: (server.address, ["--data", str(data[n])]) for n in BODIES}
            runs = paired.alternate(configs, common, args.rounds, "wiretypes")
    result: dict[str, Any] = {
        "command": "python -m perf.wiretypes " + " ".join(argv or sys.argv[1:]),
        "model": str(model),
        "image": list(IMAGE),
        "rounds": args.rounds,
        "call": args.call,
        "answers": checks,
        "request_bytes": sizes(image, args.call),
        "sweeps": summarize(runs),
    }
    paired.save(result, args.out)
    print(table(result))
    if args.out:
        print(f"\nwrote {args.out}")
    exact = checks["uint8_equals_fp32"] and checks["fp16_equals_fp32"]
    return 0 if exact and checks["cast_1_255_vs_x_255_relative"] <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
