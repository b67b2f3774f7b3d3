"""The figures of the large-tensor scenario (perf/tensors.py): what it sweeps, ONNX Runtime
alone in this process, the medians over rounds, the goals as ratios of them and the table.
Nothing here starts a process, so the unit tier can check the arithmetic."""

from __future__ import annotations

import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from perf import paired
from sluice.perf import h2engine

IMAGE = (1, 3, 224, 224)  # 602 KB of FP32
ORT_THREADS = (1, 2)
MAX_ORT_RUNS = 100_000  # the time bound ends a run first, this one if a run were ~free
# The server's log line when it picks a model's threads (server/dataplane/engine.py); no line
# means the model ran under the parallel threshold and got 1.
THREADS_LINE = re.compile(r"(\S+\.onnx): a batch of one takes .*: (\d+) intra-op threads")


@dataclass(frozen=True)
class Cell:
    """One configuration swept: which process it calls, at which levels, with which flags."""

    target: str
    levels: str
    args: tuple[str, ...]


def cells(image: str, hop_levels: str) -> dict[str, Cell]:
    """Every configuration; `image` is the .npy file of the 602 KB input."""
    big = ("--data", image)
    return {
        "echo-602k": Cell("echo", "1", big),
        "pool": Cell("off", "1", ("--model", "pool", *big)),
        "squeezenet": Cell("off", "1", ("--model", "squeezenet", *big)),
        # the same body to the served model's floor and to the server with ONNX Runtime's arena
        "squeezenet-floor": Cell("floor", "1", ("--model", "squeezenet", *big)),
        "squeezenet-arena": Cell("arena", "1", ("--model", "squeezenet", *big)),
        "echo-digits": Cell("echo", "32", ()),
        # c=1 is also the direct path of the digits hop
        "digits-off": Cell("off", "1,32", ("--model", "digits")),
        "digits-hits": Cell("hits", "32", ()),
        "balancer-digits": Cell("balancer", hop_levels, ("--model", "digits")),
        "proxy-digits": Cell("proxy", hop_levels, ("--model", "digits")),
        "balancer-602k": Cell("balancer", hop_levels, ("--model", "pool", *big)),
        "proxy-602k": Cell("proxy", hop_levels, ("--model", "pool", *big)),
    }


def ort_alone(
    model: Path, array: np.ndarray, threads: int, spinning: bool, seconds: float
) -> dict[str, float]:
    """ONNX Runtime alone in this process, with the server's session options: p50 of a run
    and CPU time per run (this process's, so every ORT thread counts), in ms."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = False
    spin = "1" if spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: array}
    for _ in range(20):
        session.run(None, feed)
    times: list[float] = []
    cpu = time.process_time()
    end = time.perf_counter() + seconds
    while len(times) < MAX_ORT_RUNS:
        started = time.perf_counter()
        session.run(None, feed)
        now = time.perf_counter()
        times.append(now - started)
        if now >= end:
            break
    cpu = time.process_time() - cpu
    return {
        "p50": float(np.median(times) * 1e3),
        "cpu_ms": cpu / len(times) * 1e3,
        "runs": float(len(times)),
    }


def ort_configs(pool: Path, squeezenet: Path) -> dict[str, tuple[Path, int, bool]]:
    """ONNX Runtime alone: the averaging model as the server runs it (1 thread, no spinning),
    and the SqueezeNet on each thread count, spinning off and on."""
    found = {"pool": (pool, 1, False)}
    for spinning in (False, True):
        for threads in ORT_THREADS:
            name = f"squeezenet-{threads}t-spin-{'on' if spinning else 'off'}"
            found[name] = (squeezenet, threads, spinning)
    return found


def rotated(names: Sequence[str], r: int) -> list[str]:
    return [*names[r % len(names) :], *names[: r % len(names)]]


def median_cpu(runs: Sequence[dict[str, Any]], level: int) -> float | None:
    """Median over rounds of a level's target CPU per call (ms); None if never measured."""
    values = [
        run["levels"][level]["target_cpu"]["per_call_ms"]
        for run in runs
        if run["levels"][level]["target_cpu"].get("per_call_ms") is not None
    ]
    return float(statistics.median(values)) if values else None


def summarize(
    runs: Mapping[str, Sequence[dict[str, Any]]], plan: Mapping[str, Cell]
) -> dict[str, Any]:
    """Per configuration: each level's medians (p50, p99, throughput, cpu_ms) as `c<level>`,
    the failed calls over all rounds, and each round's p50 and cpu_ms for the record."""
    result: dict[str, Any] = {}
    for name, found in runs.items():
        levels = plan[name].levels.split(",")
        cell = paired.summary({name: found}, levels)[name]
        for i, level in enumerate(levels):
            cell[f"c{level}"]["cpu_ms"] = median_cpu(found, i)
            cell[f"c{level}"]["rounds"] = [
                {
                    "p50": run["levels"][i]["latency"]["p50"],
                    "cpu_ms": run["levels"][i]["target_cpu"].get("per_call_ms"),
                }
                for run in found
            ]
        cell["saturated"] = paired.saturated({name: found})
        cell["warnings"] = sorted({w for run in found for w in run["warnings"]})
        result[name] = cell
    return result


def ort_summary(runs: Mapping[str, Sequence[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        name: {k: float(statistics.median(r[k] for r in rs)) for k in ("p50", "cpu_ms")}
        for name, rs in runs.items()
    }


def best(ort_figures: Mapping[str, dict[str, float]], spinning: str | None) -> str:
    """The SqueezeNet configuration with the lowest p50 (of those spinning `spinning`, or of
    all when None)."""
    names = [
        n
        for n in ort_figures
        if n.startswith("squeezenet-") and (spinning is None or n.endswith(f"spin-{spinning}"))
    ]
    return min(names, key=lambda n: ort_figures[n]["p50"])


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def difference(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def total(a: float | None, b: float | None) -> float | None:
    return a + b if a is not None and b is not None else None


def goal(name: str, measured: float | None, limit: float, unit: str, floor: str) -> dict[str, Any]:
    """One goal: PASS when measured, MISS over the limit, n/a when a figure is missing."""
    verdict = "n/a" if measured is None else "PASS" if measured <= limit else "MISS"
    return {
        "goal": name,
        "measured": measured,
        "limit": limit,
        "unit": unit,
        "floor": floor,
        "result": verdict,
    }


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def goals(
    sweeps: Mapping[str, Any], ort_figures: Mapping[str, dict[str, float]], hop: str
) -> list[dict[str, Any]]:
    """The issue's goals for one engine's figures; `hop` is the level (`c1`, `c32`) whose
    CPU per call judges the hop."""
    echo, pool = sweeps["echo-602k"]["c1"], sweeps["pool"]["c1"]
    found = [
        goal(
            "averaging model, c=1 p50 / the echo floor's (602 KB)",
            ratio(pool["p50"], echo["p50"]),
            1.3,
            "x",
            f"echo {ms(echo['p50'])} ms; ONNX Runtime alone {ms(ort_figures['pool']['p50'])} ms",
        ),
        *squeezenet_goals(sweeps, ort_figures),
    ]
    echo32 = sweeps["echo-digits"]["c32"]
    for name, label, limit in (("digits-off", "cache off", 1.5), ("digits-hits", "hits", 1.15)):
        found.append(
            goal(
                f"digits at 32 in flight, {label}: CPU per call / the echo floor's",
                ratio(sweeps[name]["c32"]["cpu_ms"], echo32["cpu_ms"]),
                limit,
                "x",
                f"echo {ms(echo32['cpu_ms'])} ms",
            )
        )
    for body, direct, limit in (("digits", "digits-off", 0.20), ("602k", "pool", 0.30)):
        base = sweeps[direct]["c1"]["p50"]
        balancer, proxy = sweeps[f"balancer-{body}"], sweeps[f"proxy-{body}"]
        found.append(
            goal(
                f"balancer hop, {body}: added c=1 p50 (ms)",
                difference(balancer["c1"]["p50"], base),
                limit,
                "ms",
                f"bare proxy +{ms(difference(proxy['c1']['p50'], base))} ms",
            )
        )
    for body in ("digits", "602k"):
        balancer, proxy = sweeps[f"balancer-{body}"][hop], sweeps[f"proxy-{body}"][hop]
        found.append(
            goal(
                f"balancer hop, {body}: CPU per forwarded call ({hop}) / the bare proxy's",
                ratio(balancer["cpu_ms"], proxy["cpu_ms"]),
                0.8,
                "x",
                f"bare proxy {ms(proxy['cpu_ms'])} ms/call",
            )
        )
    return found


# The SqueezeNet's configurations judged against (ONNX Runtime alone + echo), by goal label
SQUEEZENETS = (
    ("squeezenet", "squeezenet"),
    ("squeezenet-floor", "squeezenet floor (bare grpc.aio + ORT inline)"),
    ("squeezenet-arena", "squeezenet --ort-arena on"),
)


def squeezenet_goals(
    sweeps: Mapping[str, Any], ort_figures: Mapping[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """The SqueezeNet's goals, p50 within 1.15x and CPU per call within 1.25x: served (arena
    off and on) and the served-model floor against (ONNX Runtime alone + the echo of the same
    body), then served against that floor, with the same headroom over what a bare server
    doing the same work reaches."""
    echo = sweeps["echo-602k"]["c1"]
    chosen = best(ort_figures, "off")  # the server's own spinning setting
    alone = ort_figures[chosen]
    found = []
    for name, label in SQUEEZENETS:
        cell = sweeps[name]["c1"]
        found += [
            goal(
                f"{label}, c=1 p50 / (ONNX Runtime alone, best threads + echo)",
                ratio(cell["p50"], alone["p50"] + echo["p50"]),
                1.15,
                "x",
                f"{chosen} {ms(alone['p50'])} + echo {ms(echo['p50'])} ms",
            ),
            goal(
                f"{label}, CPU per call / (ONNX Runtime alone's + echo's)",
                ratio(cell["cpu_ms"], total(alone["cpu_ms"], echo["cpu_ms"])),
                1.25,
                "x",
                f"{chosen} {ms(alone['cpu_ms'])} + echo {ms(echo['cpu_ms'])} ms",
            ),
        ]
    floor = sweeps["squeezenet-floor"]["c1"]
    for name, label in (SQUEEZENETS[0], SQUEEZENETS[2]):
        cell = sweeps[name]["c1"]
        found += [
            goal(
                f"{label}, c=1 p50 / the floor's",
                ratio(cell["p50"], floor["p50"]),
                1.15,
                "x",
                f"floor {ms(floor['p50'])} ms",
            ),
            goal(
                f"{label}, CPU per call / the floor's",
                ratio(cell["cpu_ms"], floor["cpu_ms"]),
                1.25,
                "x",
                f"floor {ms(floor['cpu_ms'])} ms",
            ),
        ]
    return found


def served_threads(log: str, model: Path) -> int:
    """The intra-op threads the server chose for `model`, from its log."""
    for found in THREADS_LINE.finditer(log):
        if found[1] == model.name:
            return int(found[2])
    return 1


ROWS = (  # (label, configuration, level, CPU whose); ORT alone rows are added in between
    ("echo floor, 602 KB body", "echo-602k", "c1", "echo"),
    ("averaging model served, cache off", "pool", "c1", "server"),
    ("squeezenet served, cache off", "squeezenet", "c1", "server"),
    ("squeezenet floor: perf/echo_server.py --model", "squeezenet-floor", "c1", "floor"),
    ("squeezenet served, cache off, --ort-arena on", "squeezenet-arena", "c1", "server"),
    ("digits: echo floor", "echo-digits", "c32", "echo"),
    ("digits: server, cache off", "digits-off", "c32", "server"),
    ("digits: server, cache hits", "digits-hits", "c32", "server"),
    ("digits hop: direct", "digits-off", "c1", "server"),
    ("digits hop: sluice-balancer", "balancer-digits", "", "balancer"),
    ("digits hop: perf/bare_proxy.py", "proxy-digits", "", "proxy"),
    ("602 KB hop: direct (averaging model)", "pool", "c1", "server"),
    ("602 KB hop: sluice-balancer", "balancer-602k", "", "balancer"),
    ("602 KB hop: perf/bare_proxy.py", "proxy-602k", "", "proxy"),
)


def markdown(result: dict[str, Any]) -> str:
    engines = list(result["engines"])
    ctx = result["context"]
    ort_figures = result["ort_alone"]
    lines = [
        f"`{result['command']}` at {ctx['commit']}, {ctx['started']}, {ctx['cpus']} CPUs, "
        f"load average {ctx['loadavg_before'][0]:.2f} before and {ctx['loadavg_after'][0]:.2f} "
        f"after; {result['rounds']} alternating rounds, medians."
        + (f" {ctx['note']}" if ctx["note"] else ""),
        "",
        "| row | load | CPU of | "
        + " | ".join(f"{e} p50 ms | {e} CPU/call ms" for e in engines)
        + " |",
        "|---|---|---|" + "---:|---:|" * len(engines),
    ]

    def row(label: str, load: str, whose: str, cells: list[tuple[float | None, ...]]) -> None:
        figures = " | ".join(f"{ms(p50)} | {ms(cpu)}" for p50, cpu in cells)
        lines.append(f"| {label} | {load} | {whose} | {figures} |")

    def swept(label: str, name: str, level: str, whose: str) -> None:
        level = level or result["hop_level"]
        per_engine = [result["sweeps"][e][name][level] for e in engines]
        row(label, level.replace("c", "c="), whose, [(c["p50"], c["cpu_ms"]) for c in per_engine])

    def alone(label: str, name: str) -> None:
        figures = ort_figures[name]
        row(label, "in-process", "ORT", [(figures["p50"], figures["cpu_ms"])] * len(engines))

    for label, name, level, whose in ROWS:
        if name == "pool" and level == "c1" and label.startswith("averaging"):
            alone("averaging model, ONNX Runtime alone (1 thread)", "pool")
        if name == "squeezenet":
            for ort_name in ort_figures:
                if ort_name.startswith("squeezenet-"):
                    alone(f"squeezenet, ONNX Runtime alone, {ort_name[11:]}", ort_name)
        if name.startswith("squeezenet"):  # the floor and the arena server run these too
            label += f" (intra-op threads: {result['squeezenet_threads']}, spinning off)"
        swept(label, name, level, whose)
        if result["hop_level"] != "c1" and name.startswith(("balancer", "proxy")):
            level = "c1"
            per_engine = [result["sweeps"][e][name][level] for e in engines]
            row(label, "c=1", whose, [(c["p50"], c["cpu_ms"]) for c in per_engine])
    lines += [
        "",
        f"ONNX Runtime alone's best p50 of all: {result['ort_best_any']} "
        f"({ms(ort_figures[result['ort_best_any']]['p50'])} ms); the goals take the best "
        "with spinning off, the server's setting. The echo floor answers every call with one "
        "digits-sized reply (the averaging model's reply holds 12 bytes of data, the "
        "SqueezeNet's 4 KB). The squeezenet floor is a bare grpc.aio server running ONNX "
        "Runtime inline on a view of the same body, the server's session options, answering "
        "its outputs; it and the --ort-arena server run the served squeezenet's threads.",
        "",
        "| goal | engine | measured | limit | floor beside it | result |",
        "|---|---|---:|---:|---|---|",
    ]
    for engine in engines:
        for g in result["goals"][engine]:
            value = "-" if g["measured"] is None else f"{g['measured']:.2f}{g['unit']}"
            lines.append(
                f"| {g['goal']} | {engine} | {value} | {g['limit']:g}{g['unit']} "
                f"| {g['floor']} | **{g['result']}** |"
            )
    for engine in engines:
        failed = sum(cell["errors"] for cell in result["sweeps"][engine].values())
        saturated = [n for n, cell in result["sweeps"][engine].items() if cell["saturated"]]
        lines.append(
            f"\n{engine}: {failed} failed calls"
            + (f"; load generator saturated in: {', '.join(saturated)}" if saturated else "")
        )
    return "\n".join(lines)


def engines_of(text: str) -> list[str]:
    """The engines asked for that can run here."""
    asked = [e.strip() for e in text.split(",") if e.strip()]
    unknown = set(asked) - {"python", "h2load"}
    if unknown or not asked:
        raise SystemExit(f"--engines: python and/or h2load, not {text!r}")
    if "h2load" in asked and not h2engine.available():
        print(f"h2load left out: {h2engine.MISSING}", file=sys.stderr)
        asked.remove("h2load")
    if not asked:
        raise SystemExit(h2engine.MISSING)
    return asked
