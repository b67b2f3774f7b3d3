"""GPU check, for a machine with an NVIDIA GPU (scripts/gpu-check wraps it):

1. the CUDA execution provider really runs the model (not a silent CPU fallback);
2. each instance has its own CUDA stream, and staging buffers are pinned host memory
   (both need CuPy: pip install 'sluice[gpu]');
3. batches through IO binding on CUDA equal ONNX Runtime on the CPU, for the bundled digits
   model and a compute-heavy MLP;
4. latency and throughput of a real server on the GPU, batch-of-one against the
   micro-batcher, from the sweep.

Exits 1 when a check fails; prints a JSON summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from sluice.models import DIGITS
from sluice.perf import paired
from sluice.perf.make_mlp import cached
from sluice.runtime.launch import running, server_argv
from sluice.server.dataplane.batcher import Pending
from sluice.server.dataplane.engine import CUDA, Engine


def check(condition: bool, what: str, failures: list[str]) -> None:
    print(("ok    " if condition else "FAIL  ") + what, flush=True)
    if not condition:
        failures.append(what)


async def compare(model: Path, rows: Sequence[int], tolerance: float, failures: list[str]) -> None:
    engine = Engine(model, device="cuda", instances=2)
    cpu = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    check(engine.provider == CUDA, f"{model.name}: CUDA provider active", failures)
    check(engine.pinned, f"{model.name}: pinned staging buffers (CuPy present)", failures)
    streams = {inst.stream[1] for inst in engine.instances if inst.stream is not None}
    check(
        len(streams) == len(engine.instances),
        f"{model.name}: one CUDA stream per instance",
        failures,
    )
    name = engine.inputs[0].name
    outputs = tuple(s.name for s in engine.outputs)
    rng = np.random.default_rng(0)
    parts = [rng.uniform(0, 16, (n, 64)).astype(np.float32) for n in rows]
    batch = [Pending({name: p}, outputs, len(p), "g", 0.0) for p in parts]
    for instance in engine.instances:
        results = await instance.run(batch)
        for part, result in zip(parts, results, strict=True):
            want = cpu.run(list(outputs), {name: part})
            for out, expected in zip(outputs, want, strict=True):
                ok = np.allclose(result[out], expected, rtol=tolerance, atol=tolerance)
                if expected.dtype.kind in "iu":
                    ok = np.mean(result[out] == expected) > 0.99  # ties may flip an argmax
                check(
                    ok, f"{model.name}: instance {instance.index} {out} rows={len(part)}", failures
                )
    engine.close()


def serve(duration: str, rounds: int) -> dict[str, Any]:
    heavy = cached(width=4096, depth=2)
    common = ["--device", "cuda", "--cache-entries", "0", "--instances", "2"]
    with (
        running(server_argv(*common, model=heavy, node_id="one")) as one,
        running(server_argv(*common, "--max-batch", "64", model=heavy, node_id="batched")) as b,
    ):
        runs = paired.rounds(
            {"batch_of_one": one.address, "batched": b.address},
            ["-c", "1,64", "-z", duration, "--warmup", "1s", "--unique", "--procs", "2"],
            rounds,
            "gpu",
        )
    return {
        name: {
            f"c{c}": {k: paired.median(r, i, k) for k in ("throughput", "p50", "p99")}
            for i, c in enumerate((1, 64))
        }
        for name, r in runs.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.perf.gpu_check", description=__doc__)
    parser.add_argument("--duration", default="5s")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    failures: list[str] = []
    if CUDA not in ort.get_available_providers():
        print("FAIL  this onnxruntime build has no CUDA provider")
        return 1
    heavy = cached(width=4096, depth=2)
    asyncio.run(compare(DIGITS, [1, 3, 7], 1e-4, failures))
    asyncio.run(compare(heavy, [1, 5, 32], 2e-2, failures))  # TF32 matmuls on recent GPUs
    figures = serve(args.duration, args.rounds) if not failures else {}
    print(json.dumps({"failures": failures, "figures": figures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
