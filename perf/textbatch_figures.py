"""The figures of the variable-length text scenario (perf/textbatch.py): the requests' lengths,
their inputs and padding, ONNX Runtime alone's three ways of running them (one by one, padded
to the longest of each 16, padded within power-of-two length buckets), the figures of a
measured window, the medians over rounds, the goals and the table. Nothing here starts a
process, so the unit tier can check the arithmetic."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

LOW, HIGH = 8, 128  # the shortest and longest request, in tokens
# Lognormal lengths, clipped: half the requests at 24 tokens or fewer, ~1.4% at the longest.
MEDIAN, SIGMA = 24.0, 0.8
ROWS = 16  # rows a batch may hold, the batcher's and ONNX Runtime alone's
RTOL = 1e-5  # answers against batch-of-one's, relative to their largest magnitude
IDS = (1000, 8000)  # token ids drawn: past special tokens, inside any usual vocabulary
INTEGERS: dict[str, type[np.integer[Any]]] = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
PLANS = ("one-by-one", "padded-to-longest", "bucketed")
# The goals' bounds: throughput against batch-of-one's and ONNX Runtime's bucketed rows/s,
# and requests per batch.
OVER_SINGLE, OVER_ORT, MEAN_BATCH = 1.0, 0.9, 3.0


def lengths(count: int, seed: int = 0, low: int = LOW, high: int = HIGH) -> list[int]:
    """`count` request lengths: most short, a tail to `high`, the same for the same seed."""
    rng = np.random.default_rng(seed)
    drawn = np.exp(rng.normal(math.log(MEDIAN), SIGMA, size=count))
    return [int(n) for n in np.clip(np.rint(drawn), low, high)]


@dataclass(frozen=True)
class Input:
    """A model input the requests fill: [batch, sequence] integers."""

    name: str
    dtype: type[np.integer[Any]]


def text_inputs(session: ort.InferenceSession) -> list[Input]:
    """The model's inputs, each an integer tensor of rank 2 (ids, masks, token types); a
    ValueError naming the first that is not."""
    found = []
    for arg in session.get_inputs():
        if arg.type not in INTEGERS or len(arg.shape) != 2:
            raise ValueError(
                f"input {arg.name!r} is {arg.type} {arg.shape}: a text model's inputs are "
                "[batch, sequence] int64 or int32 (ids, attention masks, token types)"
            )
        found.append(Input(arg.name, INTEGERS[arg.type]))
    return found


def request(inputs: Sequence[Input], length: int, rng: np.random.Generator) -> dict[str, Any]:
    """One request of `length` tokens, [1, length] each: a mask of ones (any input named
    *mask*), token types 0 (*type*), random ids otherwise."""
    out: dict[str, np.ndarray] = {}
    for spec in inputs:
        if "mask" in spec.name:
            out[spec.name] = np.ones((1, length), spec.dtype)
        elif "type" in spec.name:
            out[spec.name] = np.zeros((1, length), spec.dtype)
        else:
            out[spec.name] = rng.integers(*IDS, size=(1, length)).astype(spec.dtype)
    return out


def requests(inputs: Sequence[Input], sizes: Sequence[int], seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [request(inputs, n, rng) for n in sizes]


def parse_pads(items: Sequence[str], inputs: Sequence[Input]) -> dict[str, int]:
    """--pad NAME=VALUE items as {name: value}; none given: every input padded with 0. A
    ValueError for an item that is not NAME=INTEGER or names no input."""
    if not items:
        return {spec.name: 0 for spec in inputs}
    names = {spec.name for spec in inputs}
    pads = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not equals or not value.lstrip("-").isdigit():
            raise ValueError(f"--pad {item!r}: NAME=INTEGER, e.g. input_ids=0")
        if name not in names:
            raise ValueError(f"--pad {item!r}: the model has no input {name!r} ({sorted(names)})")
        pads[name] = int(value)
    return pads


def padded(
    rows: Sequence[Mapping[str, np.ndarray]], length: int, pads: Mapping[str, int]
) -> dict[str, np.ndarray]:
    """Requests of [1, own length] stacked into [rows, length], each input filled past a
    row's length with its pad value (0 for an input not in `pads`)."""
    out = {}
    for name, first in rows[0].items():
        batch = np.full((len(rows), length), pads.get(name, 0), first.dtype)
        for i, row in enumerate(rows):
            batch[i, : row[name].shape[1]] = row[name][0]
        out[name] = batch
    return out


def bucket(length: int, top: int = HIGH) -> int:
    """The power of two a length is padded to, at most `top`."""
    return min(top, 1 << max(0, length - 1).bit_length())


@dataclass(frozen=True)
class Batch:
    """One run of ONNX Runtime alone: which requests (by index), padded to which length."""

    members: tuple[int, ...]
    length: int


def plan(name: str, sizes: Sequence[int], rows: int = ROWS, top: int = HIGH) -> list[Batch]:
    """The batches of one way of running the requests: one-by-one; padded-to-longest, each
    `rows` in arrival order padded to its longest; bucketed, each length bucket's requests
    in arrival order, `rows` at a time, padded to the bucket."""
    if name == "one-by-one":
        return [Batch((i,), n) for i, n in enumerate(sizes)]
    if name == "padded-to-longest":
        chunks = [range(i, min(i + rows, len(sizes))) for i in range(0, len(sizes), rows)]
        return [Batch(tuple(c), max(sizes[i] for i in c)) for c in chunks]
    if name == "bucketed":
        by_bucket: dict[int, list[int]] = {}
        for i, n in enumerate(sizes):
            by_bucket.setdefault(bucket(n, top), []).append(i)
        return [
            Batch(tuple(members[j : j + rows]), length)
            for length, members in sorted(by_bucket.items())
            for j in range(0, len(members), rows)
        ]
    raise ValueError(f"no plan {name!r}: one of {', '.join(PLANS)}")


def efficiency(batches: Sequence[Batch], sizes: Sequence[int]) -> float:
    """Real tokens over the tokens run, padding included."""
    real = sum(sizes[i] for b in batches for i in b.members)
    return real / sum(len(b.members) * b.length for b in batches)


def session(model: str | bytes, threads: int) -> ort.InferenceSession:
    """An ONNX Runtime session with the server's CPU options: all graph optimizations,
    `threads` intra-op threads, one inter-op, no arena, no spinning."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = False
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def ort_alone(
    run: ort.InferenceSession,
    batches: Sequence[Batch],
    reqs: Sequence[Mapping[str, np.ndarray]],
    pads: Mapping[str, int],
    seconds: float,
) -> dict[str, float]:
    """Whole passes over `batches` (their feeds padded beforehand, untimed) until `seconds`
    have gone, after one unmeasured pass: rows/s, and this process's CPU per row (ms)."""
    feeds = [padded([reqs[i] for i in b.members], b.length, pads) for b in batches]
    for feed in feeds:
        run.run(None, feed)
    rows = 0
    cpu, started = time.process_time(), time.perf_counter()
    while True:
        for feed, b in zip(feeds, batches, strict=True):
            run.run(None, feed)
            rows += len(b.members)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            break
    cpu = time.process_time() - cpu
    return {"rows_per_s": rows / elapsed, "cpu_ms_per_row": cpu / rows * 1e3, "rows": rows}


# A server's window: what one configuration's closed loop measured.


def window(
    times: Sequence[float],
    elapsed: float,
    errors: int,
    server_cpu_s: float,
    client_cpu_s: float,
    batcher: tuple[int, int] | None,
    tokens: tuple[float, float] | None,
    model_s: float | None = None,
    closed: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The figures of one measured window: the calls' times (seconds) over `elapsed`, the
    server's and the client's CPU seconds over it, the batcher's (batches, requests) run in
    it, the (real, padded) tokens the server counted in it, the wall seconds its model runs
    took and its batches by what closed them (full, budget, drained) (None: not
    reported)."""
    calls = len(times)
    mean_batch = None
    if batcher is not None and batcher[0] > 0:
        mean_batch = batcher[1] / batcher[0]
    padding = tokens[0] / tokens[1] if tokens is not None and tokens[1] > 0 else None
    return {
        "calls": calls,
        "errors": errors,
        "rows_per_s": calls / elapsed if elapsed > 0 else 0.0,
        "p50": float(np.percentile(times, 50) * 1e3) if calls else None,
        "p99": float(np.percentile(times, 99) * 1e3) if calls else None,
        "server_cpu_ms_per_row": server_cpu_s / calls * 1e3 if calls else None,
        "client_cpu_ms_per_row": client_cpu_s / calls * 1e3 if calls else None,
        "model_ms_per_row": model_s / calls * 1e3 if calls and model_s is not None else None,
        "batches": batcher[0] if batcher is not None else None,
        "batched_requests": batcher[1] if batcher is not None else None,
        "mean_batch": mean_batch,
        "padding_efficiency": padding,
        "closed_by": dict(closed) if closed is not None else None,
    }


def median_of(values: Sequence[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return float(statistics.median(found)) if found else None


MEDIANS = (
    "rows_per_s",
    "p50",
    "p99",
    "server_cpu_ms_per_row",
    "client_cpu_ms_per_row",
    "model_ms_per_row",
    "mean_batch",
    "padding_efficiency",
)


def summarize(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration: the medians over rounds, the calls and errors of all rounds, the
    batches, requests and what closed the batches summed, and each round's rows/s."""
    result: dict[str, dict[str, Any]] = {}
    for name, found in runs.items():
        cell: dict[str, Any] = {k: median_of([r[k] for r in found]) for k in MEDIANS}
        cell["calls"] = sum(r["calls"] for r in found)
        cell["errors"] = sum(r["errors"] for r in found)
        for key in ("batches", "batched_requests"):
            counted = [r[key] for r in found if r[key] is not None]
            cell[key] = sum(counted) if counted else None
        closed = [r["closed_by"] for r in found if r["closed_by"] is not None]
        cell["closed_by"] = {k: sum(c[k] for c in closed) for k in closed[0]} if closed else None
        cell["rounds_rows_per_s"] = [r["rows_per_s"] for r in found]
        result[name] = cell
    return result


def ort_summary(runs: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        name: {
            k: float(statistics.median(r[k] for r in found))
            for k in ("rows_per_s", "cpu_ms_per_row")
        }
        for name, found in runs.items()
    }


# Answers.


def relative(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference over the largest magnitude of `want` (a layer norm's outputs
    cross zero, where an element's own relative error means nothing); inf if the shapes
    differ."""
    if got.shape != want.shape:
        return math.inf
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return float(np.max(np.abs(got - want))) / (scale or 1.0) if want.size else 0.0


def compare(
    got: Sequence[Mapping[str, np.ndarray]], want: Sequence[Mapping[str, np.ndarray]]
) -> dict[str, Any]:
    """Answers against the reference answers of the same requests: the worst relative
    difference of each output, and the requests whose answers are not within RTOL (or lack
    an output, or have another shape)."""
    worst: dict[str, float] = {}
    differ = []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        bad = a.keys() != b.keys()
        for name in b:
            error = relative(a[name], b[name]) if name in a else math.inf
            worst[name] = max(worst.get(name, 0.0), error)
            bad = bad or not error <= RTOL
        if bad:
            differ.append(i)
    return {"checked": len(want), "worst": worst, "differ": differ, "equal": not differ}


# Goals and the table.


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def at_least(name: str, measured: float | None, bound: float, floor: str) -> dict[str, Any]:
    """One goal: PASS when measured reaches the bound, MISS under it, n/a when a figure is
    missing."""
    verdict = "n/a" if measured is None else "PASS" if measured >= bound else "MISS"
    return {"goal": name, "measured": measured, "bound": bound, "floor": floor, "result": verdict}


def goals(
    sweeps: Mapping[str, Mapping[str, Any]],
    ort_figures: Mapping[str, Mapping[str, float]],
    answers: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """The scenario's goals, from the medians: the batched server's rows/s against
    batch-of-one's and against ONNX Runtime's bucketed rows/s, its mean batch, and its
    answers against batch-of-one's (`answers`: compare's, with the batches they ran in)."""
    batched, single = sweeps["batched"], sweeps["single"]
    bucketed = ort_figures["bucketed"]["rows_per_s"]
    worst = max(answers["worst"].values(), default=None)
    return [
        at_least(
            "batcher + padding rows/s / batch-of-one's",
            ratio(batched["rows_per_s"], single["rows_per_s"]),
            OVER_SINGLE,
            f"batch-of-one {fmt(single['rows_per_s'], 0)} rows/s",
        ),
        at_least(
            "batcher + padding rows/s / ONNX Runtime alone's, bucketed",
            ratio(batched["rows_per_s"], bucketed),
            OVER_ORT,
            f"ONNX Runtime bucketed {fmt(bucketed, 0)} rows/s",
        ),
        at_least(
            "batcher + padding: mean batch (requests per batch)",
            batched["mean_batch"],
            MEAN_BATCH,
            f"{batched['batched_requests']} requests in {batched['batches']} batches",
        ),
        {
            "goal": "answers equal batch-of-one's (largest relative difference)",
            "measured": worst,
            "bound": RTOL,
            "floor": f"{answers['checked']} requests in {answers['batches']} batches, "
            f"{len(answers['differ'])} differ",
            "result": "PASS" if answers["equal"] and answers["checked"] else "MISS",
        },
    ]


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(result: Mapping[str, Any]) -> str:
    ctx, sweeps, ort_figures = result["context"], result["sweeps"], result["ort_alone"]
    sizes = result["lengths"]
    lines = [
        f"`{result['command']}` at {ctx['commit']}, {ctx['started']}, {ctx['cpus']} CPUs, "
        f"load average {ctx['loadavg_before'][0]:.2f} before and {ctx['loadavg_after'][0]:.2f} "
        f"after; {result['rounds']} alternating rounds of {result['seconds']:g} s, medians; "
        f"{result['callers']} callers; {len(sizes)} requests of {min(sizes)}-{max(sizes)} "
        f"tokens (median {statistics.median(sizes):g}, mean {statistics.mean(sizes):.1f}); "
        f"the model on {result['threads']} intra-op thread(s)."
        + (f" {ctx['note']}" if ctx["note"] else ""),
        "",
        "| configuration | rows/s | mean batch | padding efficiency | p50 ms | p99 ms "
        "| server CPU/row ms | model ms/row | client CPU/row ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label in result["labels"].items():
        if name in sweeps:
            c = sweeps[name]
            lines.append(
                f"| {label} | {fmt(c['rows_per_s'], 0)} | {fmt(c['mean_batch'])} "
                f"| {fmt(c['padding_efficiency'])} | {fmt(c['p50'])} | {fmt(c['p99'])} "
                f"| {fmt(c['server_cpu_ms_per_row'], 3)} | {fmt(c['model_ms_per_row'], 3)} "
                f"| {fmt(c['client_cpu_ms_per_row'], 3)} "
                f"| {c['errors']} |"
            )
        else:
            figures, batch = ort_figures[name], result["ort_mean_batch"][name]
            wall = 1e3 / figures["rows_per_s"]  # all of its time is the model's
            lines.append(
                f"| {label} | {fmt(figures['rows_per_s'], 0)} | {fmt(batch)} "
                f"| {fmt(result['ort_efficiency'][name])} | - | - "
                f"| {fmt(figures['cpu_ms_per_row'], 3)} (ORT) | {fmt(wall, 3)} | - | - |"
            )
    lines += ["", "| goal | measured | bound | beside it | result |", "|---|---:|---:|---|---|"]
    for g in result["goals"]:
        form = ".2f" if g["bound"] >= 0.01 else ".1e"
        measured = "-" if g["measured"] is None else format(g["measured"], form)
        lines.append(
            f"| {g['goal']} | {measured} | {g['bound']:g} | {g['floor']} | **{g['result']}** |"
        )
    return "\n".join(lines)
