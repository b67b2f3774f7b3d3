"""Text requests of their own lengths (8-128 tokens, most short) into a text encoder at 16
callers: the server batch-of-one, the micro-batcher as it groups by exact shape, and the
micro-batcher padding within length buckets, beside ONNX Runtime alone running the same
requests one by one, padded to the longest of each 16, and padded within power-of-two
buckets. One command:

  python -m perf.textbatch --duration 10s --out docs/results/textbatch.json
  python -m perf.textbatch --model my-encoder.onnx --pad input_ids=0 --pad attention_mask=0
  python -m perf.textbatch --device cuda --callers 32   # a GPU: the servers and ORT alone on CUDA
  python -m perf.textbatch --variant two=--instances=2  # another padding server, side by side

The model is perf/make_text.py's (cached) unless --model names another ONNX text model
(inputs [batch, sequence] integers: ids, attention masks, token types), with --pad NAME=VALUE
handed to the padding server (default: every input padded with 0).

Processes, all on this host (127.0.0.1): three sluice-server on the model, cache off, one
worker, the same intra-op threads (--threads) and model instances (--instances: two by
default, so one runs while the loop answers the other's callers), on --device (cpu, or
cuda: refused at once without a CUDA provider and a GPU):
  - single: --max-batch 1;
  - unpadded: --max-batch 16 --batch-budget-ms 10 (requests batch only at equal lengths);
  - batched: the same with --pad for every padded input and --max-length (buckets: the
    server's default, powers of two up to it);
  - one more for each --variant NAME=FLAGS: the padding server with FLAGS (comma-separated)
    after its own, e.g. `--variant budget2=--batch-budget-ms=2`.
Each configuration is a closed loop of --callers asyncio callers over one AsyncSluiceClient in
this process, after a warmup; the callers take the next of the fixed requests (encoded
beforehand) in turn, so every configuration and ONNX Runtime alone run the same requests in
the same order. Beside them, the floor of the callers: the same callers in this process
each awaiting ONNX Runtime alone on its own request through one runner thread (the server's
hop to its model, without gRPC). rows/s is answers over the window; p50/p99 from each
call's time; server CPU per row from /proc/PID/stat; the model's own time per row from the
server's metrics (sluice_model_seconds: its runs' wall time as the server awaited them)
(the floor's: its runner thread's CPU and its runs' wall time); mean batch, padding
efficiency (real over padded tokens) and what closed the batches from the server's Health
(BatcherStats over the window). ONNX Runtime alone runs in this process with the server's
session options and threads. The order of configurations rotates every round; figures are
medians over rounds. Then a sample of the requests is sent to the batched server all at
once (so they batch) and to batch-of-one one at a time: every output equal within 1e-5
relative.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perf import make_text, paired
from perf import textbatch_figures as tf
from perf.launch import Process, children, cpu_seconds, running, server_argv
from perf.observe import free_port
from perf.shm_figures import model_seconds
from perf.tensors_figures import rotated
from sluice.client import AsyncSluiceClient
from sluice.core.errors import Unavailable
from sluice.perf.sweep import duration
from sluice.runtime.process import event_loop
from sluice.server.dataplane.engine import choose_providers
from sluice.wire import codec

MODEL = "text"
REQUESTS = 1024  # the fixed requests, cycled through
SAMPLE = 64  # requests whose answers are checked
BATCHER = ("--max-batch", str(tf.ROWS), "--batch-budget-ms", "10")
LABELS = {
    "single": "server, batch-of-one (--max-batch 1)",
    "unpadded": "server, batcher, no padding (exact shapes)",
    "batched": "server, batcher + padding in length buckets",
    "callers": "the callers' floor: ONNX Runtime alone one by one, awaited by the callers",
    "one-by-one": "ONNX Runtime alone, one by one",
    "padded-to-longest": "ONNX Runtime alone, each 16 padded to the longest",
    "bucketed": "ONNX Runtime alone, 16 at a time within power-of-two buckets",
}


@dataclass(frozen=True)
class Server:
    """A started server and the port of its metrics (for the model's own time)."""

    proc: Process
    metrics: int

    def cpu(self) -> float:
        return cpu_seconds([self.proc.pid, *children(self.proc.pid)])


def parse_variants(items: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """--variant NAME=FLAGS items as {name: flags}, FLAGS split at commas; a ValueError for
    an item without a name or flags, or a name already taken."""
    variants: dict[str, tuple[str, ...]] = {}
    for item in items:
        name, equals, flags = item.partition("=")
        if not name.isidentifier() or not equals or not flags:
            raise ValueError(f"--variant {item!r}: NAME=FLAGS, e.g. two=--instances=2")
        if name in LABELS or name in variants:
            raise ValueError(f"--variant {item!r}: the name {name!r} is taken")
        variants[name] = tuple(flags.split(","))
    return variants


def labels(variants: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """The table's rows in order: the servers, the variants after the padding server."""
    named = {n: f"server, batcher + padding, {' '.join(f)}" for n, f in variants.items()}
    order = [*list(LABELS)[:3], *named, *list(LABELS)[3:]]
    return {name: named.get(name) or LABELS[name] for name in order}


def start(
    stack: ExitStack,
    model: Path,
    device: str,
    threads: int,
    instances: int,
    pads: Mapping[str, int],
    max_length: int,
    variants: Mapping[str, Sequence[str]],
) -> dict[str, Server]:
    padding = [arg for name, value in pads.items() for arg in ("--pad", f"{name}={value}")]
    padding += ["--max-length", str(max_length)]
    extras = {"single": ("--max-batch", "1"), "unpadded": BATCHER, "batched": (*BATCHER, *padding)}
    extras |= {name: (*BATCHER, *padding, *flags) for name, flags in variants.items()}
    servers = {}
    for name, extra in extras.items():
        port = free_port()
        argv = server_argv(
            *("--device", device, "--cache-entries", "0", "--workers", "1"),
            *("--intra-op-threads", str(threads), "--instances", str(instances)),
            *("--metrics-port", str(port)),
            *("--model", f"{MODEL}={model}", *extra),
            node_id=name,
        )
        servers[name] = Server(stack.enter_context(running(argv, start_s=60.0)), port)
    return servers


async def closed_loop(
    client: AsyncSluiceClient, bodies: Sequence[bytes], callers: int, seconds: float
) -> tuple[list[float], float, int]:
    """`callers` callers, each sending the next request in turn until `seconds` have gone:
    each answered call's time, the window's length (to the last answer) and the failed
    calls. The bodies are encoded beforehand, so the client's own cost per call is only
    the call's."""
    times: list[float] = []
    failed = taken = 0
    started = time.perf_counter()
    end = started + seconds

    async def caller() -> None:
        nonlocal taken, failed
        while time.perf_counter() < end:
            body = bodies[taken % len(bodies)]
            taken += 1
            t = time.perf_counter()
            reply = await client.call_raw(body, timeout=30.0)
            if reply.code:
                failed += 1
            else:
                times.append(time.perf_counter() - t)

    await asyncio.gather(*(caller() for _ in range(callers)))
    return times, time.perf_counter() - started, failed


async def measure(
    server: Server, bodies: Sequence[bytes], callers: int, seconds: float, warmup: float
) -> dict[str, Any]:
    """One configuration's window: warmup, then the counters before, the closed loop, and
    the counters after."""
    async with AsyncSluiceClient(server.proc.address, timeout=30.0) as client:
        await closed_loop(client, bodies, callers, warmup)
        before = (await client.health(model=MODEL)).batcher
        ran, cpu, client_cpu = model_seconds(server.metrics), server.cpu(), time.process_time()
        times, elapsed, failed = await closed_loop(client, bodies, callers, seconds)
        client_cpu, cpu = time.process_time() - client_cpu, server.cpu() - cpu
        model_s = model_seconds(server.metrics)[0] - ran[0]
        after = (await client.health(model=MODEL)).batcher
    batcher = (after.batches - before.batches, after.requests - before.requests)
    tokens = (after.real_tokens - before.real_tokens, after.padded_tokens - before.padded_tokens)
    closed = {
        "full": after.flush_full - before.flush_full,
        "budget": after.flush_budget - before.flush_budget,
        "drained": after.flush_drained - before.flush_drained,
    }
    return tf.window(times, elapsed, failed, cpu, client_cpu, batcher, tokens, model_s, closed)


async def callers_floor(
    alone: Any, reqs: Sequence[Mapping[str, np.ndarray]], callers: int, seconds: float
) -> dict[str, Any]:
    """The same closed loop of callers without gRPC: each awaits ONNX Runtime alone on its
    own request in one runner thread. "server CPU" is the runner thread's (ONNX Runtime's
    with one intra-op thread), "client CPU" the rest of this process's (the callers' loop)."""
    runner = ThreadPoolExecutor(1, thread_name_prefix="floor-run")
    loop = asyncio.get_running_loop()
    runner_cpu = runner_wall = 0.0
    taken = 0
    times: list[float] = []

    def run(feed: Mapping[str, np.ndarray]) -> None:
        nonlocal runner_cpu, runner_wall
        t, wall = time.thread_time(), time.perf_counter()
        alone.run(None, dict(feed))
        runner_cpu += time.thread_time() - t
        runner_wall += time.perf_counter() - wall

    async def caller(end: float) -> None:
        nonlocal taken
        while time.perf_counter() < end:
            feed = reqs[taken % len(reqs)]
            taken += 1
            t = time.perf_counter()
            await loop.run_in_executor(runner, run, feed)
            times.append(time.perf_counter() - t)

    try:
        warm_end = time.perf_counter() + min(1.0, seconds)
        await asyncio.gather(*(caller(warm_end) for _ in range(callers)))
        times.clear()
        runner_cpu = runner_wall = 0.0
        cpu, started = time.process_time(), time.perf_counter()
        end = started + seconds
        await asyncio.gather(*(caller(end) for _ in range(callers)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        runner.shutdown(wait=True)
    return tf.window(times, elapsed, 0, runner_cpu, cpu - runner_cpu, None, None, runner_wall)


async def answers(
    address: str, reqs: Sequence[Mapping[str, np.ndarray]], together: bool
) -> tuple[list[dict[str, np.ndarray]], tuple[int, int]]:
    """The answers of `reqs`, sent all at once (`together`, so a batcher groups them) or one
    after another, and the (batches, requests) the server ran them in."""
    async with AsyncSluiceClient(address, timeout=60.0) as client:
        before = (await client.health(model=MODEL)).batcher
        if together:
            got = list(await asyncio.gather(*(client.predict(r, model=MODEL) for r in reqs)))
        else:
            got = [await client.predict(r, model=MODEL) for r in reqs]
        after = (await client.health(model=MODEL)).batcher
    return got, (after.batches - before.batches, after.requests - before.requests)


def run_async(coroutine: Any) -> Any:
    with asyncio.Runner(loop_factory=event_loop) as runner:
        return runner.run(coroutine)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m perf.textbatch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", default="10s", help="measured time per server window")
    parser.add_argument("--warmup", default="1s", help="unmeasured calls before each window")
    parser.add_argument(
        "--ort-seconds", type=float, default=3.0, help="ONNX Runtime alone, per way, per round"
    )
    parser.add_argument("--callers", type=int, default=16, help="closed-loop callers")
    parser.add_argument(
        "--threads", type=int, default=1, help="the model's intra-op threads, everywhere"
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=2,
        help="model instances of every server (on 2 cores one instance sat idle while the "
        "loop answered its callers: 384 rows/s padded against 549 with two)",
    )
    parser.add_argument(
        "--model", default="", help="an ONNX text model (default: perf/make_text.py's)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the servers and ONNX Runtime alone run the model",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another padding server with these server flags, comma-separated, measured "
        "beside the others (repeat), e.g. two=--instances=2",
    )
    parser.add_argument(
        "--pad",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an input the padding server pads, and with what (repeat; default: every input, 0)",
    )
    parser.add_argument(
        "--max-length", type=int, default=tf.HIGH, help="the longest request, in tokens"
    )
    parser.add_argument("--seed", type=int, default=0, help="the lengths' and ids' seed")
    parser.add_argument("--note", default="", help="context for the report (the machine's load)")
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.rounds, args.callers, args.threads, args.instances) < 1:
        raise SystemExit("--rounds, --callers, --threads and --instances must be at least 1")
    if args.max_length < tf.LOW:
        raise SystemExit(f"--max-length must be at least {tf.LOW}")
    seconds, warmup = duration(args.duration), duration(args.warmup)
    model = Path(args.model) if args.model else make_text.cached()
    if not model.is_file():
        raise SystemExit(f"--model {model}: no such file")
    try:
        providers = choose_providers(args.device)
        variants = parse_variants(args.variant)
    except (Unavailable, ValueError) as exc:
        raise SystemExit(str(exc)) from exc
    ctx = paired.context(args.note)
    alone = tf.session(str(model), args.threads)
    alone.set_providers(providers)
    try:
        inputs = tf.text_inputs(alone)
        pads = tf.parse_pads(args.pad, inputs)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    sizes = tf.lengths(REQUESTS, args.seed, high=args.max_length)
    reqs = tf.requests(inputs, sizes, args.seed)
    bodies = [codec.encode_predict(r, (), MODEL) for r in reqs]
    plans = {name: tf.plan(name, sizes, top=args.max_length) for name in tf.PLANS}
    served = ("single", "unpadded", "batched", *variants)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in (*served, "callers")}
    ort_runs: dict[str, list[dict[str, float]]] = {name: [] for name in tf.PLANS}
    with ExitStack() as stack:
        servers = start(
            stack, model, args.device, args.threads, args.instances, pads, args.max_length, variants
        )
        for r in range(args.rounds):
            for name in rotated([*runs, *ort_runs], r):
                if name in ort_runs:
                    ort_runs[name].append(
                        tf.ort_alone(alone, plans[name], reqs, pads, args.ort_seconds)
                    )
                elif name == "callers":
                    floor = callers_floor(alone, reqs, args.callers, seconds)
                    runs[name].append(run_async(floor))
                else:
                    window = measure(servers[name], bodies, args.callers, seconds, warmup)
                    runs[name].append(run_async(window))
                print(f"textbatch round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
            ctx["loadavg_rounds"].append(list(os.getloadavg()))
        sample = [reqs[i] for i in range(0, len(reqs), len(reqs) // SAMPLE)][:SAMPLE]
        got, ran = run_async(answers(servers["batched"].proc.address, sample, together=True))
        want, _ = run_async(answers(servers["single"].proc.address, sample, together=False))
    ctx["loadavg_after"] = list(os.getloadavg())
    checked = {**tf.compare(got, want), "batches": ran[0]}
    sweeps = tf.summarize(runs)
    ort_figures = tf.ort_summary(ort_runs)
    result: dict[str, Any] = {
        "command": "python -m perf.textbatch "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "context": ctx,
        "rounds": args.rounds,
        "seconds": seconds,
        "callers": args.callers,
        "threads": args.threads,
        "instances": args.instances,
        "device": args.device,
        "variants": {name: list(flags) for name, flags in variants.items()},
        "model": str(model),
        "pads": pads,
        "lengths": sizes,
        "labels": labels(variants),
        "ort_alone": ort_figures,
        "ort_alone_rounds": ort_runs,
        "ort_mean_batch": {n: len(sizes) / len(p) for n, p in plans.items()},
        "ort_efficiency": {n: tf.efficiency(p, sizes) for n, p in plans.items()},
        "sweeps": sweeps,
        "runs": runs,
        "answers": checked,
        "goals": tf.goals(sweeps, ort_figures, checked),
    }
    paired.save(result, args.out)
    print(tf.markdown(result))
    if args.out:
        print(f"\nwrote {args.out}")
    if not checked["equal"]:
        print(f"answers differ from batch-of-one's: requests {checked['differ']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
