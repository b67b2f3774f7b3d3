"""A compute-heavy model at concurrency 1: the server with its default (auto) intra-op
threads against ONNX Runtime's best time on this machine plus the echo floor, with h2load.

  python -m perf.fitted --rounds 3 --duration 4s

The model is the onnx wheel's light squeezenet (FP32 [1, 3, 224, 224], a 602 KB input);
ONNX Runtime's best is its fastest median over 1 to 4 intra-op threads; the echo floor is
perf/echo_server.py answering the same body. Cache off; the server and the echo alternate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from perf import paired
from perf.launch import module_argv, running, server_argv
from sluice.perf import h2engine, histograms
from sluice.perf.sweep import request_body

MODEL = Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"
PREDICT = "/sluice.v1.Inference/Predict"


def ort_best_ms(x: np.ndarray, runs: int = 50) -> dict[int, float]:
    """ONNX Runtime alone, batch 1: the median run time for 1 to 4 intra-op threads."""
    found = {}
    for threads in (1, 2, 3, 4):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(MODEL), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        for _ in range(5):
            session.run(None, {name: x})
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            session.run(None, {name: x})
            times.append(time.perf_counter() - started)
        found[threads] = statistics.median(times) * 1e3
    return found


def p50_ms(target: str, body: bytes, duration: float) -> float:
    h2engine.check_call(target, PREDICT, body, 10.0)
    level = h2engine.run_level(target, PREDICT, body, 1, 1, duration, 1.0)
    return float(histograms.summarize(histograms.merge([level.histogram])).p50)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.fitted", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if not h2engine.available():
        raise SystemExit(h2engine.MISSING)
    x = np.random.default_rng(0).random((1, 3, 224, 224), np.float32)
    body = request_body(x, "data_0", "predict", "")
    ort_ms = ort_best_ms(x)
    p50: dict[str, list[float]] = {"server": [], "echo": []}
    with ExitStack() as stack:
        server = stack.enter_context(
            running(server_argv("--cache-entries", "0", node_id="fitted", model=MODEL))
        )
        echo = stack.enter_context(running(module_argv("perf.echo_server")))
        targets = {"server": server.address, "echo": echo.address}
        for r in range(args.rounds):
            for name in list(targets)[:: 1 if r % 2 == 0 else -1]:
                p50[name].append(p50_ms(targets[name], body, args.duration))
                print(f"fitted round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
        threads = next(
            (line for line in server.lines if "intra-op threads" in line), "(not logged)"
        )
    best = min(ort_ms.values())
    server_p50, echo_p50 = (statistics.median(p50[n]) for n in ("server", "echo"))
    result: dict[str, Any] = {
        "command": "python -m perf.fitted " + " ".join(argv or sys.argv[1:]),
        "ort_median_ms_by_threads": ort_ms,
        "p50_ms": p50,
        "server_threads": threads.strip(),
        "server_vs_ort_best_plus_echo": server_p50 / (best + echo_p50),
    }
    print(paired.save(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
