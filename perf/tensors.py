"""What a call costs with a real tensor, side by side in one run: a 1x3x224x224 FP32 body
(602 KB) and the bundled digits model, each beside the floor it is judged against.

  python -m perf.tensors --rounds 3 --duration 3s --out docs/results/tensors.json

Rows (c=1 p50 and the target's CPU per call, `sluice perf`'s target_cpu):
  - the echo floor (perf/echo_server.py) carrying the 602 KB body;
  - the averaging model (perf/make_pool.py): ONNX Runtime alone in this process, and served
    by sluice-server with its cache off;
  - the SqueezeNet (perf/make_squeezenet.py): ONNX Runtime alone on 1 and 2 threads, spinning
    off (as the server runs it) and on; served; its floor (perf/echo_server.py --model: a
    bare grpc.aio server running ONNX Runtime inline); served with --ort-arena on (the floor
    and the arena server on the threads the server chose);
  - digits at 32 in flight: the echo floor, the server with its cache off, cache hits;
  - the hop on digits and on the 602 KB body: direct, sluice-balancer, perf/bare_proxy.py
    (CPU per call: the forwarding process's own).

Every configuration is swept once a round with each engine (python, and h2load when it is
on PATH), in an order that rotates every round, so drift on a shared machine hits each
alike; figures are medians over rounds and the goals are ratios of those medians
(perf/tensors_figures.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from perf import make_pool, make_squeezenet, paired
from perf.launch import BIN, module_argv, running, server_argv
from perf.tensors_figures import (
    IMAGE,
    best,
    cells,
    engines_of,
    goals,
    markdown,
    ort_alone,
    ort_configs,
    ort_summary,
    rotated,
    served_threads,
    summarize,
)
from sluice import models


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m perf.tensors", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", default="3s", help="per level per round")
    parser.add_argument("--warmup", default="0.5s", help="unrecorded time before each level")
    parser.add_argument(
        "--ort-seconds", type=float, default=1.5, help="ONNX Runtime alone, per configuration"
    )
    parser.add_argument(
        "--hop-levels",
        default="1",
        help="the hop's levels; the last judges CPU per forwarded call (c=1 p50 always)",
    )
    parser.add_argument(
        "--engines",
        default="python,h2load",
        help="load generators; h2load is left out when it is not on PATH",
    )
    parser.add_argument("--note", default="", help="context for the report (the machine's load)")
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    hop_levels = args.hop_levels.split(",")
    if "1" not in hop_levels:
        raise SystemExit("--hop-levels must include 1 (the added p50 is read at c=1)")
    engines = engines_of(args.engines)
    ctx = paired.context(args.note)
    pool, squeeze = make_pool.cached(IMAGE[2]), make_squeezenet.cached(IMAGE[2])
    array = np.random.default_rng(0).standard_normal(IMAGE, dtype=np.float32)
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        image = folder / "image.npy"
        np.save(image, array)
        plan = cells(str(image), args.hop_levels)
        off = stack.enter_context(
            running(
                server_argv(
                    "--device",
                    "cpu",
                    "--cache-entries",
                    "0",
                    *("--model", f"digits={models.DIGITS}"),
                    *("--model", f"pool={pool}"),
                    *("--model", f"squeezenet={squeeze}"),
                    node_id="off",
                ),
                start_s=60.0,
            )
        )
        # The threads the server chose for the squeezenet, so its floor and the arena server
        # run the same: the one lever apart is what each compares.
        threads = served_threads(off.log(), squeeze)
        floor = stack.enter_context(
            running(
                module_argv("perf.echo_server", "--model", str(squeeze), "--threads", str(threads))
            )
        )
        arena = stack.enter_context(
            running(
                server_argv(
                    "--device",
                    "cpu",
                    "--cache-entries",
                    "0",
                    *("--intra-op-threads", str(threads)),
                    *("--ort-arena", "on"),
                    *("--model", f"squeezenet={squeeze}"),
                    node_id="arena",
                ),
                start_s=60.0,
            )
        )
        hits = stack.enter_context(running(server_argv("--device", "cpu", node_id="hits")))
        addresses = {
            "echo": stack.enter_context(running(module_argv("perf.echo_server"))).address,
            "off": off.address,
            "floor": floor.address,
            "arena": arena.address,
            "hits": hits.address,
            "balancer": stack.enter_context(
                running([str(BIN / "sluice-balancer"), "--port", "0", "--backend", off.address])
            ).address,
            "proxy": stack.enter_context(
                running(module_argv("perf.bare_proxy", "--backend", off.address))
            ).address,
        }
        alone = ort_configs(pool, squeeze)
        ort_runs: dict[str, list[dict[str, float]]] = {name: [] for name in alone}
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            e: {n: [] for n in plan} for e in engines
        }
        for r in range(args.rounds):
            for name in rotated(list(alone), r):
                model, threads, spinning = alone[name]
                ort_runs[name].append(ort_alone(model, array, threads, spinning, args.ort_seconds))
            for engine in rotated(engines, r):
                common = ["--engine", engine, "-z", args.duration, "--warmup", args.warmup]
                for name in rotated(list(plan), r):
                    cell = plan[name]
                    extra = [*common, "-c", cell.levels, *cell.args]
                    runs[engine][name].append(paired.sweep_once(addresses[cell.target], extra))
                print(f"tensors round {r + 1}/{args.rounds}: {engine} done", file=sys.stderr)
    ctx["loadavg_after"] = list(os.getloadavg())
    ort_figures = ort_summary(ort_runs)
    hop = f"c{hop_levels[-1]}"
    sweeps = {e: summarize(runs[e], plan) for e in engines}
    result: dict[str, Any] = {
        "command": "python -m perf.tensors " + " ".join(argv or sys.argv[1:]),
        "context": ctx,
        "rounds": args.rounds,
        "engines": engines,
        "models": {"pool": str(pool), "squeezenet": str(squeeze), "digits": str(models.DIGITS)},
        "squeezenet_threads": threads,
        "ort_alone": ort_figures,
        "ort_alone_rounds": ort_runs,
        "ort_best_any": best(ort_figures, None),
        "hop_level": hop,
        "sweeps": sweeps,
        "goals": {e: goals(sweeps[e], ort_figures, hop) for e in engines},
    }
    paired.save(result, args.out)
    print(markdown(result))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
