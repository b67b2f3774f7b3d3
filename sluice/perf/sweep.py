"""`sluice perf` / `python -m sluice.perf.sweep`: a ghz-style load sweep against a server or a
balancer. Each level runs in `--procs` load-generator processes whose HDR histograms are
merged; every level reports throughput, errors by status, latency percentiles, the load
generator's own CPU use, the target's Health deltas and, for a local target, its CPU time
per call (sluice.perf.target).

  python -m sluice.perf.sweep --target 127.0.0.1:8001 -c 1,4,16 -z 5s --out perf/results/run1
  python -m sluice.perf.sweep --target 127.0.0.1:8001 --rps 500,1000,2000 -z 5s --unique
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from sluice import models
from sluice.client import connect
from sluice.client.connect import PLAINTEXT, Connection
from sluice.client.core import auth_metadata
from sluice.core.datatypes import DATATYPES
from sluice.core.keys import PREDICT
from sluice.kserve import grpc_predict_v2_pb2 as kserve
from sluice.perf import h2engine, histograms, loadgen, report
from sluice.perf.loadgen import (
    LEVEL_STRIDE,
    PROCESS_STRIDE,
    SWEEP_STRIDE,
    UNIQUE_ELEMENTS,
    Bodies,
    LevelResult,
    LevelSpec,
    run_level_in_process,
)
from sluice.perf.target import Meter, processes
from sluice.runtime.tls import blocking_channel
from sluice.v1 import inference_pb2 as pb
from sluice.v1 import inference_pb2_grpc as pb_grpc
from sluice.wire import codec

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"

CONTROL_TIMEOUT = 10.0  # Metadata and Health calls, whatever --timeout says
SATURATED = 0.85  # a load-generator process busier than this share of a core is the limit


@dataclass
class Level:
    mode: str  # "concurrency" or "rate"
    value: float
    calls: int = 0
    ok: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    throughput: float = 0.0  # answered calls per second, errors included
    goodput: float = 0.0  # OK calls per second
    latency: histograms.Latency = field(
        default_factory=lambda: histograms.summarize(histograms.new_histogram())
    )
    client_cpu: float = 0.0  # busiest load-generator process, share of one core
    client_saturated: bool = False
    max_outstanding: int = 0
    server: dict[str, float] = field(default_factory=dict)
    # The target's CPU from the end of the warm-up to the end of the level (Meter):
    # pids, found (how), children, cpu_s, per_call_ms, cores; empty when not measured.
    target_cpu: dict[str, Any] = field(default_factory=dict)


def duration(text: str) -> float:
    """Seconds from `5`, `5s`, `500ms` or `1m`."""
    text = text.strip().lower()
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def number_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas: {text}")
    return values


def pid_list(text: str) -> list[int]:
    pids = [v.strip() for v in text.split(",") if v.strip()]
    if not pids or not all(v.isdigit() and int(v) > 0 for v in pids):
        raise argparse.ArgumentTypeError(f"expected pids separated by commas: {text}")
    return [int(v) for v in pids]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice perf",
        description="Load sweep against a Sluice server or balancer (ghz-style).",
    )
    connect.add_target(p, "HOST:PORT; several, comma-separated, with --embedded")
    p.add_argument(
        "--call",
        choices=["predict", "stream", "modelinfer"],
        default="predict",
        help="unary Predict, PredictStream multiplexing calls on one stream per connection, "
        "or the KServe v2 protocol's unary ModelInfer",
    )
    p.add_argument(
        "--model", default="", help="the model to call by name (default: the target's default)"
    )
    p.add_argument(
        "--engine",
        choices=["python", "h2load"],
        default="python",
        help="the load generator: this Python one, or h2load (nghttp2's C client: it costs "
        "the target's cores little; one body replayed, closed-loop levels, unary calls)",
    )
    p.add_argument(
        "--embedded",
        action="store_true",
        help="balance over the targets inside the client (as SluiceClient does with several)",
    )
    p.add_argument(
        "--data",
        default="samples",
        help="'samples' (the bundled digits), FILE.npy, FILE.json or inline JSON",
    )
    p.add_argument("--input-name", default="", help="input to fill (default: the model's first)")
    p.add_argument(
        "--unique", action="store_true", help="a fresh input per call, so no cache can answer"
    )
    p.add_argument("-c", "--concurrency", type=number_list, help="closed-loop levels, e.g. 1,4,16")
    p.add_argument("--rps", type=number_list, help="open-loop levels in calls/s, e.g. 500,1000")
    p.add_argument("-n", "--total", type=int, default=0, help="calls per level")
    p.add_argument("-z", "--duration", type=duration, default=0.0, help="time per level (5s)")
    p.add_argument("--warmup", type=duration, default=0.5, help="unrecorded time before a level")
    p.add_argument("--connections", type=int, default=1, help="connections per process")
    p.add_argument("--procs", type=int, default=1, help="load-generator processes")
    p.add_argument("--timeout", type=duration, default=10.0, help="deadline per call")
    p.add_argument(
        "--target-cpu",
        choices=["auto", "off"],
        default="auto",
        help="auto: the target's CPU time per call, when it runs on this machine (found by "
        "its port: every process listening there, with their children); off: not measured",
    )
    p.add_argument(
        "--target-pid",
        type=pid_list,
        default=[],
        metavar="PID[,PID]",
        help="the processes whose CPU is the target's (with their children), instead of "
        "those found by the port, e.g. a supervisor holding no socket",
    )
    p.add_argument(
        "--out",
        default="",
        help=f"write OUT.json, .csv, .md and .png (the plot needs matplotlib: {report.PNG_EXTRA})",
    )
    p.add_argument("--title", default="", help="title for the report and plot")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no live table or summary: the results go to --out only (which it needs)",
    )
    # With --engine h2load: https, a server certificate h2load itself does not check (the
    # real call before each level does), and no client certificate.
    connect.add_options(p)
    return p


def control_channel(target: str, connection: Connection) -> grpc.Channel:
    """A channel for the sweep's own Metadata and Health calls."""
    return blocking_channel(target, connection.client_tls())


def model_input(
    target: str, name: str, timeout: float, model: str = "", connection: Connection = PLAINTEXT
) -> tuple[str, str]:
    """The input to fill and its datatype, from the target's Metadata."""
    with control_channel(target, connection) as channel:
        meta = pb_grpc.InferenceStub(channel).Metadata(
            pb.MetadataRequest(model=model),
            timeout=timeout,
            metadata=auth_metadata(connection.api_key),
        )
    inputs = {t.name: t.datatype for t in meta.model.inputs}
    if not inputs:
        raise SystemExit(f"{target} reports no model inputs")
    chosen = name or next(iter(inputs))
    if chosen not in inputs:
        raise SystemExit(f"{target} has no input {chosen!r}; it has {', '.join(inputs)}")
    return chosen, inputs[chosen]


def load_arrays(data: str, datatype: str) -> list[np.ndarray]:
    dtype = DATATYPES[datatype].dtype
    if data == "samples":
        return [s.input for s in models.samples()]
    if data.endswith(".npy"):
        return [np.load(data, allow_pickle=False)]
    loaded = json.loads(Path(data).read_text() if data.endswith(".json") else data)
    return [np.asarray(loaded, dtype=dtype)]


def request_body(array: np.ndarray, name: str, call: str, model: str) -> bytes:
    """One call's body: a PredictRequest as the Python client writes it (raw_data aligned),
    or a KServe v2 ModelInferRequest (raw contents)."""
    if call != "modelinfer":
        return codec.encode_predict({name: array}, model=model)
    tensor = kserve.ModelInferRequest.InferInputTensor(
        name=name, datatype=codec.datatype_of(array.dtype).name, shape=array.shape
    )
    request = kserve.ModelInferRequest(
        model_name=model, inputs=[tensor], raw_input_contents=[codec.encode(name, array).raw_data]
    )
    return request.SerializeToString()


def make_bodies(
    arrays: Sequence[np.ndarray], name: str, unique: bool, call: str = "predict", model: str = ""
) -> Bodies:
    bodies = tuple(request_body(a, name, call, model) for a in arrays)
    if not unique:
        return Bodies(bodies)
    first = arrays[0]  # unique bodies vary the first data set's values
    if first.dtype.kind == "b" or first.size < 2:
        raise SystemExit("--unique needs a numeric input of two or more elements")
    raw = codec.encode(name, first).raw_data
    return Bodies(
        bodies[:1],
        unique_offset=bodies[0].rindex(raw),
        unique_datatype=codec.datatype_of(first.dtype).name,
        unique_elements=min(first.size, UNIQUE_ELEMENTS),
    )


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def server_health(
    target: str, timeout: float, connection: Connection = PLAINTEXT
) -> pb.HealthResponse | None:
    try:
        with control_channel(target, connection) as channel:
            reply: pb.HealthResponse = pb_grpc.InferenceStub(channel).Health(
                pb.HealthRequest(), timeout=timeout, metadata=auth_metadata(connection.api_key)
            )
            return reply
    except grpc.RpcError:
        return None


def server_deltas(
    before: pb.HealthResponse | None,
    after: pb.HealthResponse | None,
    samples: Sequence[pb.HealthResponse] = (),
) -> dict[str, float]:
    """What the target saw during the level, from its Health before, during and after."""
    if before is None or after is None:
        return {}
    deltas = {
        "requests": float(after.requests - before.requests),
        "errors": float(after.errors - before.errors),
    }
    batches = after.batcher.batches - before.batcher.batches
    if batches:
        deltas["batches"] = float(batches)
        deltas["mean_batch"] = (after.batcher.requests - before.batcher.requests) / batches
        deltas["queue_depth_max"] = float(max((s.batcher.queue_depth for s in samples), default=0))
        deltas["rejected"] = float(after.batcher.rejected - before.batcher.rejected)
    looked = (after.cache.hits + after.cache.misses) - (before.cache.hits + before.cache.misses)
    if after.cache.enabled and looked:
        deltas["cache_hit_rate"] = (after.cache.hits - before.cache.hits) / looked
    return deltas


def run_level(
    pool: ProcessPoolExecutor,
    args: argparse.Namespace,
    bodies: Bodies,
    index: int,
    mode: str,
    value: float,
    base: int = 0,
    notes: list[str] | None = None,
) -> Level:
    meter = target_meter(args, [] if notes is None else notes)
    if args.engine == "h2load":
        return h2load_level(args, bodies, mode, value, meter, notes)
    connection = connect.from_args(args)
    procs = args.procs if mode == "rate" else min(args.procs, int(value))
    shares = split(int(value), procs) if mode == "concurrency" else [value / procs] * procs
    totals = split(args.total, procs) if args.total else [0] * procs
    specs = [
        LevelSpec(
            targets=tuple(args.target.split(",")),
            method=MODEL_INFER if args.call == "modelinfer" else PREDICT,
            bodies=bodies,
            call="predict" if args.call == "modelinfer" else args.call,  # unary either way
            embedded=args.embedded,
            concurrency=int(share) if mode == "concurrency" else 0,
            rate=float(share) if mode == "rate" else 0.0,
            total=totals[i],
            duration=args.duration,
            warmup=args.warmup,
            connections=args.connections,
            timeout=args.timeout,
            first_call=base + index * LEVEL_STRIDE + i * PROCESS_STRIDE,
            connection=connection,
        )
        for i, share in enumerate(shares)
    ]
    first = args.target.split(",")[0]
    before = server_health(first, CONTROL_TIMEOUT, connection)
    started = time.monotonic()
    warmed = started + args.warmup  # when the target's CPU starts to count
    if meter is not None and not args.warmup:
        meter.start()
    futures: list[Future[LevelResult]] = [pool.submit(run_level_in_process, s) for s in specs]
    samples = []  # the target's Health while the level runs: queue depth is a snapshot
    while True:
        waiting = meter is not None and not meter.started
        left = warmed - time.monotonic()
        _, pending = wait(futures, timeout=max(0.0, min(0.25, left)) if waiting else 0.25)
        if not pending:
            break
        if not args.quiet:
            report.progress(mode, value, time.monotonic() - started, args.warmup + args.duration)
        if waiting and (left := warmed - time.monotonic()) < 0.3:
            # The target's CPU is read on time at the warm-up's end, not after a Health call
            # (the load processes end their warm-ups on their own clocks, about then).
            if left <= 0:
                assert meter is not None
                meter.start()
            continue
        if before is not None and (sample := server_health(first, CONTROL_TIMEOUT, connection)):
            samples.append(sample)
    results = [f.result() for f in futures]
    if meter is not None:
        meter.stop()  # before the Health call below, which the target spends CPU on
    after = server_health(first, CONTROL_TIMEOUT, connection)
    level = summarize_level(mode, value, results, server_deltas(before, after, samples))
    return measured(level, meter, notes)


def target_meter(args: argparse.Namespace, notes: list[str]) -> Meter | None:
    """A meter of the target's CPU for the next level (the processes found anew, so workers
    a supervisor respawned between levels count), or None, with the reason in `notes`."""
    if args.target_cpu == "off":
        return None
    found = processes(args.target.split(","), args.target_pid)
    if isinstance(found, str):
        notes.append(found)
        return None
    return Meter(found)


def measured(level: Level, meter: Meter | None, notes: list[str] | None) -> Level:
    """The level with its `target_cpu` (calls: those answered, errors included)."""
    if meter is not None:
        figures = meter.figures(level.calls, level.wall_s)
        if isinstance(figures, str):
            if notes is not None:
                notes.append(f"{figures} at {level.mode} {level.value:g}")
        else:
            level.target_cpu = figures
    return level


def h2load_refusal(args: argparse.Namespace) -> str:
    """Why these options cannot run on h2load ('' when they can)."""
    if not h2engine.available():
        return h2engine.MISSING
    if args.rps:
        return "--engine h2load runs closed-loop levels (-c) only, not --rps"
    if args.unique:
        return (
            "--engine h2load replays one body: turn the target's cache off "
            "(sluice-server --cache-entries 0) instead of --unique"
        )
    if args.embedded or args.call == "stream" or args.total or len(args.target.split(",")) > 1:
        return "--engine h2load sends unary calls to one target for a time (-z), no -n"
    if args.tls_cert:
        return "h2load cannot show a client certificate (mutual TLS): use --engine python"
    return ""


def h2load_level(
    args: argparse.Namespace,
    bodies: Bodies,
    mode: str,
    value: float,
    meter: Meter | None = None,
    notes: list[str] | None = None,
) -> Level:
    """One level driven by h2load; the target's own figures around it as usual."""
    address, method = args.target, MODEL_INFER if args.call == "modelinfer" else PREDICT
    body = bodies.bodies[0]
    connection = connect.from_args(args)
    h2engine.check_call(address, method, body, CONTROL_TIMEOUT, connection)
    before = server_health(address, CONTROL_TIMEOUT, connection)
    if not args.quiet:
        report.progress(mode, value, 0.0, args.warmup + args.duration)
    result = h2engine.run_level(
        address,
        method,
        body,
        int(value),
        args.connections,
        args.duration,
        args.warmup,
        connection,
        warmed=meter.start if meter is not None else None,
    )
    if meter is not None:
        meter.stop()
    after = server_health(address, CONTROL_TIMEOUT, connection)
    level = summarize_level(mode, value, [result], server_deltas(before, after))
    return measured(level, meter, notes)


def summarize_level(
    mode: str, value: float, results: Sequence[LevelResult], server: dict[str, float]
) -> Level:
    statuses: Counter[str] = Counter()
    for r in results:
        statuses.update(r.statuses)
    wall = max(r.wall_s for r in results)
    calls = statuses.total()
    busiest = max(r.cpu_s / r.wall_s if r.wall_s else 0.0 for r in results)
    return Level(
        mode=mode,
        value=value,
        calls=calls,
        ok=statuses["OK"],
        statuses=dict(statuses),
        wall_s=wall,
        throughput=calls / wall if wall else 0.0,
        goodput=statuses["OK"] / wall if wall else 0.0,
        latency=histograms.summarize(histograms.merge([r.histogram for r in results])),
        client_cpu=busiest,
        client_saturated=busiest > SATURATED,
        max_outstanding=sum(r.max_outstanding for r in results),
        server=server,
    )


def sweep(args: argparse.Namespace, command: str = "") -> dict[str, Any]:
    target = args.target.split(",")[0]
    connection = connect.from_args(args)
    name, datatype = model_input(target, args.input_name, CONTROL_TIMEOUT, args.model, connection)
    arrays = load_arrays(args.data, datatype)
    bodies = make_bodies(arrays, name, args.unique, args.call, args.model)
    levels: list[tuple[str, float]] = [("concurrency", c) for c in args.concurrency or []]
    levels += [("rate", r) for r in args.rps or []]
    results: list[Level] = []
    notes: list[str] = []  # why a level has no target cpu/call
    base = random.randrange(10**6) * SWEEP_STRIDE  # a fresh range of unique bodies per sweep
    if not args.quiet:
        report.live_header(args.target_cpu != "off")
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.procs, mp_context=context) as pool:
        # Start every process before the first level, so none of them starts late.
        list(pool.map(loadgen.ready, [0.2] * args.procs))
        for index, (mode, value) in enumerate(levels):
            level = run_level(pool, args, bodies, index, mode, value, base, notes)
            results.append(level)
            if not args.quiet:
                report.live_row(level, args.target_cpu != "off")
    knee = histograms.find_knee(
        [lv.throughput for lv in results], [lv.latency.p99 for lv in results]
    )
    return {
        "title": args.title or f"sluice perf against {args.target}",
        "command": command,
        "target": args.target,
        "call": args.call,
        "embedded": args.embedded,
        "data": args.data,
        "unique": args.unique,
        "procs": args.procs,
        "connections": args.connections,
        "cpus": os.cpu_count(),
        "target_cpu": args.target_cpu,  # each level's figures are in its own target_cpu
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "knee": knee,
        "levels": [asdict(lv) for lv in results],
        "warnings": [
            f"load generator saturated at {lv.mode} {lv.value:g}: its busiest process used "
            f"{lv.client_cpu:.0%} of a core, so these figures bound the client, not the target"
            for lv in results
            if lv.client_saturated
        ]
        + list(dict.fromkeys(notes)),  # once each, though every level found it so
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.concurrency and not args.rps:
        args.concurrency = [1.0]
    if not args.total and not args.duration:
        args.duration = 5.0
    if args.procs < 1 or args.connections < 1:
        parser.error("--procs and --connections must be at least 1")
    if args.quiet and not args.out:  # a sweep whose results nobody would see
        parser.error("--quiet prints no results: add --out PATH to write them, or drop --quiet")
    try:
        connect.from_args(args).client_tls()  # a file that does not load is named now
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if args.engine == "h2load":
        refused = h2load_refusal(args)
        if refused:
            parser.error(refused)
    try:
        result = sweep(args, " ".join(["sluice perf", *argv]))
    except grpc.RpcError as exc:
        # What raises here is the sweep's own Metadata call, to the first target.
        exc = connect.from_args(args).explained(exc, args.target.split(",")[0])
        print(f"sluice perf: {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    for warning in result["warnings"]:
        print(f"WARNING: {warning}", file=sys.stderr)
    if not args.quiet:
        report.live_footer(result)
    if args.out:
        for path in report.write_all(result, Path(args.out)):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
