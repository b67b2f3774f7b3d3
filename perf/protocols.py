"""What the KServe v2 facade costs: ModelInfer against Predict on the same model, side by
side in one run, direct and through the balancer, plus each protocol's whole Python path in
the server timed in this process (no grpc, no noise from the other processes) and, with
--instructions, counted in instructions by valgrind.

  python -m perf.protocols --rounds 4 --duration 4s --levels 1,16

One server (bundled digits model, cache off, so every call runs the model) and one balancer
in front of it; unique inputs; the configurations alternate round by round; each figure is
the median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from perf import paired
from perf.launch import BIN, running, server_argv
from sluice import models
from sluice.perf import h2engine
from sluice.perf.sweep import MODEL_INFER, request_body
from sluice.server.dataplane.batcher import Batcher
from sluice.server.dataplane.cache import LRUCache
from sluice.server.dataplane.engine import Engine
from sluice.server.dataplane.models import Model, Models
from sluice.server.dataplane.plane import Dataplane
from sluice.server.kserve import KServeService
from sluice.server.service import InferenceService

MODEL = "digits"


class _Context:
    """What a servicer's handler reads of grpc's context, at no cost."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-request-id", "perf"),)

    def time_remaining(self) -> float:
        return 10.0

    def set_trailing_metadata(self, trailers: object) -> None:
        pass

    async def abort(self, *args: object) -> None:
        raise RuntimeError(args)


Loop = Callable[[int], Awaitable[None]]


@contextlib.asynccontextmanager
async def handler_loops() -> AsyncIterator[dict[str, Loop]]:
    """For each protocol, `loop(n)`: n calls of its handler in the server (route, decode,
    checks, the model run, encode, stats, trailers; cache off), in this process, no grpc."""
    # Every run inline on the loop: under valgrind a run is measured 50x slower, and the
    # batcher's inline-or-thread choice must not differ between the counted runs.
    engine = Engine(models.DIGITS, device="cpu", inline_max_s=1.0)
    plane = Dataplane(Models([Model(engine, Batcher(engine.instances))]), LRUCache(0, 0))
    service = InferenceService(plane, node_id="perf")
    facade = KServeService(service)
    handlers = {
        "predict": (service.handler(), "/sluice.v1.Inference/Predict"),
        "modelinfer": (facade.handler(), MODEL_INFER),
    }
    x = models.samples()[0].input
    context: Any = _Context()

    def loop_of(name: str, handler: Any, method: str) -> Loop:
        found = handler.service(SimpleNamespace(method=method, invocation_metadata=()))
        call = found.unary_unary  # the wrapped coroutine function
        body = request_body(x, "input", name, MODEL)

        async def loop(n: int) -> None:
            for _ in range(n):
                await call(body, context)

        return loop

    try:
        yield {name: loop_of(name, h, method) for name, (h, method) in handlers.items()}
    finally:
        await plane.close()


def path_cost(iterations: int) -> dict[str, float]:
    """Microseconds per call of each protocol's whole Python path in the server, in
    alternating timed loops (median of 7)."""

    async def measure() -> dict[str, float]:
        times: dict[str, list[float]] = {"predict": [], "modelinfer": []}
        async with handler_loops() as loops:
            for _ in range(7):
                for name, loop in loops.items():
                    started = time.perf_counter()
                    await loop(iterations)
                    times[name].append((time.perf_counter() - started) / iterations * 1e6)
        return {name: statistics.median(t) for name, t in times.items()}

    return asyncio.run(measure())


def instructions(calls: int) -> dict[str, float]:
    """Instructions per call of each protocol's Python path, counted by valgrind's callgrind
    (deterministic where timings are not): two runs of `--loop`, `calls` apart."""
    per_call = {}
    for name in ("predict", "modelinfer"):
        totals = []
        for n in (200, 200 + calls):
            with tempfile.TemporaryDirectory() as folder:
                loop = [sys.executable, "-m", "perf.protocols", "--loop", name, str(n)]
                out = subprocess.run(
                    ["valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/cg", *loop],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dict layouts
                )
            found = re.search(r"Collected : (\d+)", out.stderr)
            assert found, out.stderr[-2000:]
            totals.append(int(found[1]))
        per_call[name] = (totals[1] - totals[0]) / calls
    return per_call


def h2load(address: str, rounds: int, calls: int, in_flight: int) -> dict[str, list[float]]:
    """Calls/s of each protocol from h2load (nghttp2's C client, one connection, `in_flight`
    streams), replaying one gRPC-framed body, in alternating rounds: a load generator that
    costs the two cores little next to the Python one."""
    x = models.samples()[0].input
    paths = {"predict": "/sluice.v1.Inference/Predict", "modelinfer": MODEL_INFER}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    with tempfile.TemporaryDirectory() as folder:
        framed = {
            name: h2engine.frame(request_body(x, "input", name, MODEL), Path(folder) / name)
            for name in paths
        }
        for r in range(rounds):
            for name in list(paths)[:: 1 if r % 2 == 0 else -1]:
                rate = h2engine.calls_per_s(address, paths[name], framed[name], calls, 1, in_flight)
                rates[name].append(rate)
    return rates


def run_loop(name: str, n: int) -> None:
    async def go() -> None:
        async with handler_loops() as loops:
            await loops[name](n)

    asyncio.run(go())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.protocols", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", default="4s")
    parser.add_argument("--levels", default="1,16", help="concurrency levels")
    parser.add_argument("--iterations", type=int, default=3000, help="in-process loop length")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count instructions per call of each path with valgrind (slow: ~1 min)",
    )
    parser.add_argument(
        "--h2load",
        action="store_true",
        help="also compare the two with h2load against the server (when it is installed)",
    )
    parser.add_argument("--loop", nargs=2, metavar=("PROTOCOL", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.loop:  # one protocol's path, N calls: what --instructions counts
        run_loop(args.loop[0], int(args.loop[1]))
        return 0
    common = ["-c", args.levels, "-z", args.duration, "--warmup", "1s", "--unique"]
    common += ["--model", MODEL]
    with ExitStack() as stack:
        server = stack.enter_context(
            running(server_argv("--device", "cpu", "--cache-entries", "0", node_id="s"))
        )
        balancer = stack.enter_context(
            running([str(BIN / "sluice-balancer"), "--port", "0", "--backend", server.address])
        )
        configs: dict[str, tuple[str, list[str]]] = {
            "predict": (server.address, []),
            "modelinfer": (server.address, ["--call", "modelinfer"]),
            "balancer-predict": (balancer.address, []),
            "balancer-modelinfer": (balancer.address, ["--call", "modelinfer"]),
        }
        runs = paired.alternate(configs, common, args.rounds, "protocols")
        if args.h2load and shutil.which("h2load"):
            rates = h2load(server.address, args.rounds, 10_000, 32)
            medians = {name: statistics.median(r) for name, r in rates.items()}
            h2 = {
                "calls_per_s": rates,
                "modelinfer_vs_predict": (medians["modelinfer"] / medians["predict"]),
            }
    levels = args.levels.split(",")
    result: dict[str, Any] = {
        "command": "python -m perf.protocols " + " ".join(argv or sys.argv[1:])
    }
    result.update(paired.summary(runs, levels))
    for via in ("", "balancer-"):
        base, facade = result[f"{via}predict"], result[f"{via}modelinfer"]
        result[f"{via}modelinfer_vs_predict"] = {
            f"c{c}": {
                "throughput": facade[f"c{c}"]["throughput"] / base[f"c{c}"]["throughput"],
                "p50": facade[f"c{c}"]["p50"] / base[f"c{c}"]["p50"],
            }
            for c in levels
        }
    if args.h2load and shutil.which("h2load"):
        result["h2load_c32"] = h2
    result["path_us_per_call"] = cost = path_cost(args.iterations)
    result["path_modelinfer_vs_predict"] = cost["modelinfer"] / cost["predict"]
    if args.instructions:
        result["path_instructions_per_call"] = counted = instructions(2000)
        result["path_instructions_modelinfer_vs_predict"] = (
            counted["modelinfer"] / counted["predict"]
        )
    result["saturated"] = paired.saturated(runs)
    print(paired.save(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
