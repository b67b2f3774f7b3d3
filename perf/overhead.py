"""Serving overhead, measured side by side in one run: the Sluice server on the bundled model
against the echo floor (bare grpc.aio, same API, no model) plus ONNX Runtime's own run time
for the same model and input, called directly in this process.

  python -m perf.overhead --rounds 3 --duration 3s --levels 1,4,16

Rounds alternate which target goes first, so drift on a shared machine hits both alike.
The ratio reported is server p50 / (echo p50 + ONNX Runtime p50) at concurrency 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from perf import paired
from perf.launch import module_argv, running, server_argv
from sluice import models


def ort_run_ms(model: Path, runs: int = 3000, intra_op_threads: int = 1) -> dict[str, float]:
    """ONNX Runtime alone on the bundled samples at batch 1, as the server configures it."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    inputs = [s.input for s in models.samples()]
    name = session.get_inputs()[0].name
    outputs = [o.name for o in session.get_outputs()]
    for x in inputs * 20:
        session.run(outputs, {name: x})
    times = np.empty(runs)
    for i in range(runs):
        started = time.perf_counter()
        session.run(outputs, {name: inputs[i % len(inputs)]})
        times[i] = time.perf_counter() - started
    return {"p50": float(np.median(times) * 1e3), "p99": float(np.percentile(times, 99) * 1e3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.overhead", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", default="3s", help="per level per round")
    parser.add_argument("--levels", default="1,4,16", help="concurrency levels")
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    args = parser.parse_args(argv)

    ort_ms = ort_run_ms(models.DIGITS)
    with (
        running(module_argv("perf.echo_server")) as echo,
        running(server_argv("--device", "cpu", "--cache-entries", "0")) as server,
    ):
        runs = paired.rounds(
            {"echo": echo.address, "server": server.address},
            ["-c", args.levels, "-z", args.duration, "--warmup", "0.5s"],
            args.rounds,
        )
    levels = [float(v) for v in args.levels.split(",")]
    rows = []
    for i, level in enumerate(levels):
        rows.append(
            {
                "concurrency": level,
                **{
                    f"{name}_{key}": paired.median(runs[name], i, key)
                    for name in runs
                    for key in ("p50", "p99", "throughput")
                },
            }
        )
    c1 = rows[0]
    floor = c1["echo_p50"] + ort_ms["p50"]
    result = {
        "command": "python -m perf.overhead " + " ".join(argv or sys.argv[1:]),
        "ort_ms": ort_ms,
        "rows": rows,
        "ratio_c1_p50": c1["server_p50"] / floor,
        "saturated": paired.saturated(runs),
    }
    print(markdown(result))
    paired.save(result, args.out)
    return 0


def markdown(result: dict[str, Any]) -> str:
    ort_ms = result["ort_ms"]
    c1 = result["rows"][0]
    lines = [
        f"ONNX Runtime alone, batch 1: p50 {ort_ms['p50']:.3f} ms, p99 {ort_ms['p99']:.3f} ms",
        "",
        "| concurrency | echo p50 ms | server p50 ms | echo p99 ms | server p99 ms "
        "| echo calls/s | server calls/s | server/echo calls/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['concurrency']:g} | {row['echo_p50']:.3f} | {row['server_p50']:.3f} "
            f"| {row['echo_p99']:.3f} | {row['server_p99']:.3f} | {row['echo_throughput']:.0f} "
            f"| {row['server_throughput']:.0f} "
            f"| {row['server_throughput'] / row['echo_throughput']:.2f} |"
        )
    lines += [
        "",
        f"Server p50 at c=1 / (echo p50 + ONNX Runtime p50) = {c1['server_p50']:.3f} / "
        f"({c1['echo_p50']:.3f} + {ort_ms['p50']:.3f}) = **{result['ratio_c1_p50']:.2f}**",
    ]
    if result["saturated"]:
        lines.append("\n**Warning:** the load generator saturated in at least one level.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
