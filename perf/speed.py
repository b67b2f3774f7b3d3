"""Server speed, side by side in one run (docs/BENCHMARKS.md):

1. batching: a compute-heavy MLP (perf/make_mlp.py, 4096 wide) saturated with unique inputs,
   micro-batcher on against batch-of-one; p99 against the budget plus one batch's compute;
   the batcher's calls/s against ONNX Runtime's own rows/s at the mean batch it ran;
2. idle cost: at concurrency 1 on the digits model, the batcher on against the fast path;
3. cache: hits of the digits model's server against the bare echo floor.

  python -m perf.speed --rounds 2 --duration 5s
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from perf import paired
from perf.launch import module_argv, running, server_argv
from perf.make_mlp import cached


def batch_compute_ms(model: Path, rows: int, intra_op_threads: int, runs: int = 10) -> float:
    """ONNX Runtime alone on one batch of `rows`, as the server configures it: the median."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).uniform(0, 16, (rows, 64)).astype(np.float32)
    session.run(None, {"input": x})
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(None, {"input": x})
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1e3)


def batching(args: argparse.Namespace) -> dict[str, Any]:
    heavy = cached(width=4096, depth=2)
    common = ["--device", "cpu", "--intra-op-threads", "2", "--cache-entries", "0"]
    batch = ["--max-batch", str(args.max_batch), "--batch-budget-ms", str(args.budget_ms)]
    with ExitStack() as stack:
        one = stack.enter_context(running(server_argv(*common, model=heavy, node_id="one")))
        batched = stack.enter_context(
            running(server_argv(*common, *batch, model=heavy, node_id="batched"))
        )
        runs = paired.rounds(
            {"batch_of_one": one.address, "batched": batched.address},
            [
                *("-c", args.heavy_levels, "--rps", str(args.heavy_rate)),
                *("-z", args.duration, "--warmup", "1s", "--unique"),
            ],
            args.rounds,
            "batching",
        )
    compute = batch_compute_ms(heavy, args.max_batch, 2)
    levels: list[dict[str, Any]] = []
    names = [f"c={c}" for c in args.heavy_levels.split(",")] + [f"{args.heavy_rate:g}/s"]
    for i, level in enumerate(names):
        row: dict[str, Any] = {"level": level}
        for name, r in runs.items():
            row[name] = {k: paired.median(r, i, k) for k in ("throughput", "p50", "p99", "max")}
            row[name]["mean_batch"] = paired.median_server(r, i, "mean_batch")
            row[name]["errors"] = paired.median(r, i, "calls") - paired.median(r, i, "ok")
        row["throughput_ratio"] = row["batched"]["throughput"] / row["batch_of_one"]["throughput"]
        # ONNX Runtime alone at the batch size the batcher ran (one session, as the server
        # has one instance): the rows per second no server could beat at that batch size.
        size = max(round(row["batched"]["mean_batch"]), 1)
        ort_rows = size / batch_compute_ms(heavy, size, 2, runs=20) * 1e3
        row["ort_rows_per_s_at_mean_batch"] = ort_rows
        row["batched_vs_ort"] = row["batched"]["throughput"] / ort_rows
        levels.append(row)
    return {
        "levels": levels,
        "one_batch_compute_ms": compute,
        "bound_ms": args.budget_ms + compute,
        "saturated": paired.saturated(runs),
    }


def idle_cost(args: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        fast = stack.enter_context(running(server_argv("--device", "cpu", node_id="fast")))
        batched = stack.enter_context(
            running(server_argv("--device", "cpu", "--max-batch", "32", node_id="batched"))
        )
        runs = paired.rounds(
            {"fast_path": fast.address, "batcher_on": batched.address},
            ["-c", "1", "-z", args.duration, "--warmup", "1s", "--unique"],
            args.rounds,
            "idle",
        )
    result: dict[str, Any] = {
        name: {k: paired.median(r, 0, k) for k in ("p50", "p99", "throughput")}
        for name, r in runs.items()
    }
    result["p50_ratio"] = result["batcher_on"]["p50"] / result["fast_path"]["p50"]
    result["saturated"] = paired.saturated(runs)
    return result


def cache_hits(args: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        echo = stack.enter_context(running(module_argv("perf.echo_server")))
        server = stack.enter_context(running(server_argv("--device", "cpu")))
        runs = paired.rounds(
            {"echo": echo.address, "cache_hits": server.address},
            ["-c", "1,16", "-z", args.duration, "--warmup", "1s"],  # the ten samples, repeated
            args.rounds,
            "cache",
        )
    result: dict[str, Any] = {}
    for i, level in enumerate((1, 16)):
        row: dict[str, Any] = {
            name: {k: paired.median(r, i, k) for k in ("throughput", "p50", "p99")}
            for name, r in runs.items()
        }
        row["hit_rate"] = paired.median_server(runs["cache_hits"], i, "cache_hit_rate")
        row["rate_ratio"] = row["cache_hits"]["throughput"] / row["echo"]["throughput"]
        result[f"c{level}"] = row
    result["saturated"] = paired.saturated(runs)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.speed", description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", default="5s", help="per level per round")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--budget-ms", type=float, default=20.0)
    parser.add_argument("--heavy-levels", default="16,32,64", help="concurrency levels")
    parser.add_argument(
        "--heavy-rate", type=float, default=600, help="open-loop rate within batched capacity"
    )
    parser.add_argument("--only", choices=["batching", "idle", "cache"], action="append")
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    scenarios = {"batching": batching, "idle": idle_cost, "cache": cache_hits}
    result = {
        "command": "python -m perf.speed " + " ".join(argv if argv is not None else sys.argv[1:]),
        **{name: fn(args) for name, fn in scenarios.items() if not args.only or name in args.only},
    }
    print(paired.save(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
