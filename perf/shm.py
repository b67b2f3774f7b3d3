"""A 602 KB FP32 image into the SqueezeNet with its input and output in shared memory, side by
side in one run with the same image sent as bytes, direct and through sluice-balancer as a
sidecar, and with ONNX Runtime's arena on: what is left of a call once its bytes are off the
wire.

  python -m perf.shm --rounds 3 --duration 3s --out docs/results/shm.json

Processes, all on this host (127.0.0.1):
  - server: sluice-server --shared-memory (cache off, squeezenet threads: its own choice);
  - plain: the same without --shared-memory, the balancer's backend;
  - balancer: sluice-balancer --shared-memory before plain (it reads the caller's regions and
    forwards their bytes);
  - arena: as server, with --ort-arena on;
  - floor: perf/echo_server.py --model --shared-memory (ONNX Runtime inline in a bare
    grpc.aio server, reading bytes or the caller's regions through the server's functions);
  - echo: perf/echo_server.py, the echo floor (one digits-sized reply to every call).
The servers run the threads `server` chose, and serve their metrics, for the model's own wall
time per call as the server ran it (sluice_model_seconds).

Every configuration is a closed loop at c=1 in this process, after a warmup: a blocking
SluiceClient(target, shared_memory=True) (its first call sizes the outputs; from then on the
input and the output are in the client's regions) or SluiceClient(target) (bytes). p50 and p99
from each call's perf_counter time; CPU per call of each process named, from its
/proc/PID/stat utime + stime over the measured calls; this process's (the client's) likewise.
ONNX Runtime alone (tensors_figures.ort_alone, the server's options) on 1 and 2 threads, in
this process. The order of configurations rotates every round; figures are medians over rounds.
Once per configuration and round, an answer is checked equal (np.array_equal) to the bytes
answer of the same target and model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perf import make_squeezenet, paired
from perf.launch import BIN, Process, children, module_argv, running, server_argv
from perf.observe import free_port
from perf.shm_figures import (
    DIGITS,
    MODEL_RUNS_IN,
    ORT_THREADS,
    PLAN,
    Config,
    Usage,
    answers_equal,
    beside,
    check,
    goals,
    markdown,
    model_seconds,
    ort_summary,
    per_call,
    summarize,
    usage,
)
from perf.tensors_figures import IMAGE, ort_alone, rotated, served_threads
from sluice import SluiceClient, models
from sluice.perf.sweep import duration
from sluice.shm.client import signature


@dataclass
class Started:
    """The processes of the run: by name, each one's pid and address, and the metrics ports
    of the servers."""

    procs: dict[str, Process]
    metrics: dict[str, int]

    def usage(self, name: str) -> Usage:
        pid = self.procs[name].pid
        return usage([pid, *children(pid)])


def start(stack: ExitStack, squeeze: Path, threads: str) -> tuple[Started, int]:
    """Every process, stopped when `stack` closes; and the squeezenet's intra-op threads
    (`threads`: a number, or auto for the first server's choice)."""
    procs: dict[str, Process] = {}
    metrics: dict[str, int] = {}
    models_of = ("--model", f"digits={models.DIGITS}", "--model", f"squeezenet={squeeze}")

    def server(name: str, *extra: str) -> Process:
        metrics[name] = free_port()
        argv = server_argv(
            *("--device", "cpu", "--cache-entries", "0", "--workers", "1"),
            *("--metrics-port", str(metrics[name]), *models_of, *extra),
            node_id=name,
        )
        return stack.enter_context(running(argv, start_s=60.0))

    chosen = () if threads == "auto" else ("--intra-op-threads", threads)
    procs["server"] = server("server", "--shared-memory", *chosen)
    # The others run the threads it chose, so the one lever apart is what each compares.
    count = int(threads) if chosen else served_threads(procs["server"].log(), squeeze)
    pinned = ("--intra-op-threads", str(count))
    procs["plain"] = server("plain", *pinned)
    procs["arena"] = server("arena", "--shared-memory", "--ort-arena", "on", *pinned)
    floor = module_argv(
        "perf.echo_server", "--model", str(squeeze), "--threads", str(count), "--shared-memory"
    )
    procs["floor"] = stack.enter_context(running(floor))
    procs["echo"] = stack.enter_context(running(module_argv("perf.echo_server")))
    balancer = [str(BIN / "sluice-balancer"), "--port", "0", "--workers", "1"]
    balancer += ["--shared-memory", "--backend", procs["plain"].address]
    procs["balancer"] = stack.enter_context(running(balancer))
    return Started(procs, metrics), count


def drive(
    started: Started,
    config: Config,
    inputs: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray] | None,
    seconds: float,
    warmup: float,
) -> dict[str, Any]:
    """One configuration's closed loop at c=1: warmup, one answer checked, then the calls
    measured for `seconds`."""
    address = started.procs[config.target].address
    runs_in = MODEL_RUNS_IN.get(config.target)
    port = started.metrics[runs_in] if runs_in is not None else None
    with SluiceClient(address, shared_memory=config.shared) as client:
        end = time.perf_counter() + warmup
        while time.perf_counter() < end:
            client.predict(inputs, model=config.model)
        answer = client.predict(inputs, model=config.model)
        # The first answer sized the outputs (what the client learned): in its regions since.
        if config.shared and (
            client._memory is None
            or client._memory.learned.get(signature(inputs, (), config.model, "")) is None
        ):
            raise RuntimeError(f"{config.label}: the outputs were never placed in shared memory")
        before = {who: started.usage(who) for who in config.cpu_of}
        ran = model_seconds(port) if port is not None else None
        times: list[float] = []
        client_cpu = time.process_time()
        end = time.perf_counter() + seconds
        while True:
            t = time.perf_counter()
            client.predict(inputs, model=config.model)
            now = time.perf_counter()
            times.append(now - t)
            if now >= end:
                break
        client_cpu = time.process_time() - client_cpu
        after = {who: started.usage(who) for who in config.cpu_of}
        model = None
        if port is not None and ran is not None:
            counted = model_seconds(port)
            model = (counted[0] - ran[0], counted[1] - ran[1])
    figures = per_call(times, before, after, client_cpu, model)
    figures["answers_equal"] = reference is None or answers_equal(answer, reference)
    return figures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m perf.shm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", default="3s", help="measured time per configuration")
    parser.add_argument("--warmup", default="0.5s", help="unmeasured calls before each")
    parser.add_argument(
        "--ort-seconds", type=float, default=1.5, help="ONNX Runtime alone, per thread count"
    )
    parser.add_argument(
        "--threads",
        default="auto",
        help="the squeezenet's intra-op threads on every server: N, or auto (the first "
        "server's own choice, which the others then run)",
    )
    parser.add_argument("--note", default="", help="context for the report (the machine's load)")
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check(args.rounds, args.threads)
    seconds, warmup = duration(args.duration), duration(args.warmup)
    ctx = paired.context(args.note)
    squeeze = make_squeezenet.cached(IMAGE[2])
    rng = np.random.default_rng(0)
    bodies = {
        "digits": {"input": rng.standard_normal(DIGITS, dtype=np.float32)},
        "squeezenet": {"input": rng.standard_normal(IMAGE, dtype=np.float32)},
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in PLAN}
    ort_runs: dict[str, list[dict[str, float]]] = {f"{t}t": [] for t in ORT_THREADS}
    with ExitStack() as stack:
        started, threads = start(stack, squeeze, args.threads)
        # The bytes answer of each target and model, that target's other answers' reference.
        references = {}
        for config in PLAN.values():
            key = (config.target, config.model)
            if config.target != "echo" and key not in references:
                address = started.procs[config.target].address
                with SluiceClient(address) as client:
                    references[key] = client.predict(bodies[config.model], model=config.model)
        units = [*PLAN, *ort_runs]
        for r in range(args.rounds):
            for name in rotated(units, r):
                if name in ort_runs:
                    image = bodies["squeezenet"]["input"]
                    ort_runs[name].append(
                        ort_alone(squeeze, image, int(name[:-1]), False, args.ort_seconds)
                    )
                    continue
                config = PLAN[name]
                reference = references.get((config.target, config.model))
                runs[name].append(
                    drive(started, config, bodies[config.model], reference, seconds, warmup)
                )
            ctx["loadavg_rounds"].append(list(os.getloadavg()))
            print(f"shm round {r + 1}/{args.rounds} done", file=sys.stderr)
    ctx["loadavg_after"] = list(os.getloadavg())
    sweeps = summarize(runs)
    ort_figures = ort_summary(ort_runs)
    result: dict[str, Any] = {
        "command": "python -m perf.shm " + " ".join(argv if argv is not None else sys.argv[1:]),
        "context": ctx,
        "rounds": args.rounds,
        "models": {"squeezenet": str(squeeze), "digits": str(models.DIGITS)},
        "squeezenet_threads": threads,
        "threads_asked": args.threads,
        "echo_floor": "this process's own loop: SluiceClient, a 1x64 FP32 (digits-size) body",
        "ort_alone": ort_figures,
        "ort_alone_rounds": ort_runs,
        "sweeps": sweeps,
        "runs": runs,
        "goals": goals(sweeps, ort_figures),
        "beside": beside(sweeps),
    }
    paired.save(result, args.out)
    print(markdown(result))
    if args.out:
        print(f"\nwrote {args.out}")
    differ = [n for n, cell in sweeps.items() if not cell["answers_equal"]]
    if differ:
        print(f"answers differ from the bytes answers in: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
