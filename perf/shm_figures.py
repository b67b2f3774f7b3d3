"""The figures of the shared memory scenario (perf/shm.py): what it runs, one measured loop's
figures, the medians over rounds, the goals' bounds and the table. Nothing here starts a
process, so the unit tier can check the arithmetic."""

from __future__ import annotations

import statistics
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perf.tensors_figures import difference, goal, ms
from sluice.perf.target import TICK

DIGITS = (1, 64)  # the digits model's input: a tiny body
ORT_THREADS = (1, 2)
SLACK_MS = 0.1  # the first goal's headroom over ONNX Runtime alone + the echo floor
MODEL_METRIC = "sluice_model_seconds"


@dataclass(frozen=True)
class Config:
    """One configuration: the process called, the model asked, whether the tensors travel in
    shared memory, and the processes whose CPU per call is reported (the first the target)."""

    target: str
    model: str
    shared: bool
    cpu_of: tuple[str, ...]
    label: str


PLAN: dict[str, Config] = {
    "echo-digits": Config("echo", "digits", False, ("echo",), "echo floor, digits body"),
    "digits-direct": Config("plain", "digits", False, ("plain",), "digits, direct"),
    "digits-balancer": Config(
        "balancer", "digits", False, ("balancer", "plain"), "digits, through the balancer"
    ),
    "image-shm": Config("server", "squeezenet", True, ("server",), "image, shm, direct"),
    "image-shm-balancer": Config(
        "balancer", "squeezenet", True, ("balancer", "plain"), "image, shm, through the balancer"
    ),
    "image-bytes": Config("server", "squeezenet", False, ("server",), "image, bytes, direct"),
    "image-bytes-balancer": Config(
        "balancer",
        "squeezenet",
        False,
        ("balancer", "plain"),
        "image, bytes, through the balancer",
    ),
    "arena-shm": Config("arena", "squeezenet", True, ("arena",), "image, shm, --ort-arena on"),
    "arena-bytes": Config("arena", "squeezenet", False, ("arena",), "image, bytes, --ort-arena on"),
    "floor-shm": Config(
        "floor",
        "squeezenet",
        True,
        ("floor",),
        "image, shm, perf/echo_server.py --model --shared-memory",
    ),
    "floor-bytes": Config(
        "floor", "squeezenet", False, ("floor",), "image, bytes, perf/echo_server.py --model"
    ),
}
# Where each target's model runs, for its wall time per call (the servers' metrics).
MODEL_RUNS_IN = {"server": "server", "plain": "plain", "balancer": "plain", "arena": "arena"}


def per_call(
    times: Sequence[float],
    before: Mapping[str, Usage],
    after: Mapping[str, Usage],
    client_cpu: float,
    model: tuple[float, float] | None,
) -> dict[str, Any]:
    """One measured loop's figures in ms: p50 and p99 of the call times (seconds), CPU and
    minor page faults per call of each process from its usage before and after, the client's
    CPU seconds over the loop, and the model's wall time per call from the (seconds, runs)
    the server counted over it (None where nothing counts it)."""
    calls = len(times)
    ran = None
    if model is not None and model[1] > 0:
        ran = model[0] / model[1] * 1e3
    return {
        "calls": calls,
        "p50": float(np.percentile(times, 50) * 1e3),
        "p99": float(np.percentile(times, 99) * 1e3),
        "cpu_ms": {who: (after[who].cpu_s - u.cpu_s) / calls * 1e3 for who, u in before.items()},
        "faults": {who: (after[who].faults - u.faults) / calls for who, u in before.items()},
        "client_cpu_ms": client_cpu / calls * 1e3,
        "model_ms": ran,
    }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def median_of(values: Sequence[float | None]) -> float | None:
    """Median of the figures measured (None left out); None if there are none."""
    found = [v for v in values if v is not None]
    return median(found) if found else None


def summarize(runs: Mapping[str, Sequence[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration, the medians over rounds of each figure, and each round's p50."""
    result: dict[str, dict[str, Any]] = {}
    for name, found in runs.items():
        result[name] = {
            "p50": median([r["p50"] for r in found]),
            "p99": median([r["p99"] for r in found]),
            "cpu_ms": {who: median([r["cpu_ms"][who] for r in found]) for who in PLAN[name].cpu_of},
            "faults": {who: median([r["faults"][who] for r in found]) for who in PLAN[name].cpu_of},
            "client_cpu_ms": median([r["client_cpu_ms"] for r in found]),
            "model_ms": median_of([r["model_ms"] for r in found]),
            "calls": sum(r["calls"] for r in found),
            "answers_equal": all(r["answers_equal"] for r in found),
            "rounds_p50": [r["p50"] for r in found],
        }
    return result


def ort_summary(runs: Mapping[str, Sequence[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        name: {k: float(statistics.median(r[k] for r in rs)) for k in ("p50", "cpu_ms")}
        for name, rs in runs.items()
    }


def best_ort(ort_figures: Mapping[str, dict[str, float]]) -> str:
    return min(ort_figures, key=lambda n: ort_figures[n]["p50"])


def goals(
    sweeps: Mapping[str, dict[str, Any]], ort_figures: Mapping[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """The two goals: the shm image's p50 direct within ONNX Runtime alone (best threads) +
    the tiny body's echo + SLACK_MS; through the balancer within the direct figure + the
    hop's own cost (the balancer's added p50 on digits). And the first goal's two halves,
    through the shm floor (a bare Python gRPC server reading the regions and running the
    model inline): the served figure within the floor's + SLACK_MS, and the floor's within
    the first goal's bound (a MISS: the bound is below what such a server reaches here)."""
    chosen = best_ort(ort_figures)
    alone, echo = ort_figures[chosen]["p50"], sweeps["echo-digits"]["p50"]
    direct, floor = sweeps["image-shm"]["p50"], sweeps["floor-shm"]["p50"]
    hop = sweeps["digits-balancer"]["p50"] - sweeps["digits-direct"]["p50"]
    bound = f"ONNX Runtime alone {chosen} {ms(alone)} + echo (digits) {ms(echo)} + {SLACK_MS}"
    return [
        goal("image in shm, direct: c=1 p50 (ms)", direct, alone + echo + SLACK_MS, "ms", bound),
        goal(
            "image in shm, through the balancer: c=1 p50 (ms)",
            sweeps["image-shm-balancer"]["p50"],
            direct + hop,
            "ms",
            f"direct {ms(direct)} + the hop on digits {ms(hop)}",
        ),
        goal(
            "image in shm, served against the shm floor: c=1 p50 (ms)",
            direct,
            floor + SLACK_MS,
            "ms",
            f"the shm floor {ms(floor)} + {SLACK_MS}",
        ),
        goal(
            "the shm floor against the first bound: c=1 p50 (ms)",
            floor,
            alone + echo + SLACK_MS,
            "ms",
            bound,
        ),
    ]


def beside(sweeps: Mapping[str, dict[str, Any]]) -> list[tuple[str, float]]:
    """The differences of p50 (ms) the table is read by."""

    def p50(name: str) -> float:
        value: float = sweeps[name]["p50"]
        return value

    return [
        ("shm saves, direct (bytes - shm)", p50("image-bytes") - p50("image-shm")),
        (
            "shm saves, through the balancer",
            p50("image-bytes-balancer") - p50("image-shm-balancer"),
        ),
        ("the hop on digits (balancer - direct)", p50("digits-balancer") - p50("digits-direct")),
        ("the hop, image in shm", p50("image-shm-balancer") - p50("image-shm")),
        ("the hop, image as bytes", p50("image-bytes-balancer") - p50("image-bytes")),
        ("the arena, shm (arena - server)", p50("arena-shm") - p50("image-shm")),
        ("served shm over the floor's bytes", p50("image-shm") - p50("floor-bytes")),
        ("served shm over the shm floor", p50("image-shm") - p50("floor-shm")),
        ("shm saves at the floor (floor bytes - floor shm)", p50("floor-bytes") - p50("floor-shm")),
    ]


def markdown(result: dict[str, Any]) -> str:
    ctx, sweeps, ort_figures = result["context"], result["sweeps"], result["ort_alone"]
    lines = [
        f"`{result['command']}` at {ctx['commit']}, {ctx['started']}, {ctx['cpus']} CPUs, "
        f"load average {ctx['loadavg_before'][0]:.2f} before and {ctx['loadavg_after'][0]:.2f} "
        f"after; {result['rounds']} rotating rounds, medians; squeezenet on "
        f"{result['squeezenet_threads']} intra-op thread(s) (--threads "
        f"{result['threads_asked']}), spinning off." + (f" {ctx['note']}" if ctx["note"] else ""),
        "",
        "| row | p50 ms | p99 ms | CPU/call ms | faults/call | client CPU/call ms "
        "| model ms/call | answers |",
        "|---|---:|---:|---|---|---:|---:|---|",
    ]
    for name, figures in ort_figures.items():
        lines.append(
            f"| squeezenet, ONNX Runtime alone, {name} | {ms(figures['p50'])} | - "
            f"| ORT {ms(figures['cpu_ms'])} | - | - | - | - |"
        )
    for name, config in PLAN.items():
        cell = sweeps[name]
        cpu = ", ".join(f"{who} {ms(cell['cpu_ms'][who])}" for who in config.cpu_of)
        faults = ", ".join(f"{who} {cell['faults'][who]:.1f}" for who in config.cpu_of)
        checked = "-" if config.target == "echo" else "equal" if cell["answers_equal"] else "DIFFER"
        lines.append(
            f"| {config.label} | {ms(cell['p50'])} | {ms(cell['p99'])} | {cpu} | {faults} "
            f"| {ms(cell['client_cpu_ms'])} | {ms(cell['model_ms'])} | {checked} |"
        )
    lines += ["", "| goal | measured | bound | bound made of | margin | result |"]
    lines.append("|---|---:|---:|---|---:|---|")
    for g in result["goals"]:
        margin = difference(g["measured"], g["limit"])
        sign = "+" if margin is not None and margin > 0 else ""
        lines.append(
            f"| {g['goal']} | {ms(g['measured'])} | {ms(g['limit'])} | {g['floor']} "
            f"| {sign}{ms(margin)} | **{g['result']}** |"
        )
    lines += ["", "| p50 difference | ms |", "|---|---:|"]
    lines += [f"| {label} | {ms(value)} |" for label, value in result["beside"]]
    return "\n".join(lines)


def model_seconds_in(text: str) -> tuple[float, float]:
    """The model's (seconds, runs) in a Prometheus text exposition."""
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (f"{MODEL_METRIC}_sum", f"{MODEL_METRIC}_count"):
            found[name] = float(value)
    return found[f"{MODEL_METRIC}_sum"], found[f"{MODEL_METRIC}_count"]


@dataclass(frozen=True)
class Usage:
    """What a process (and its children) used so far: CPU seconds (utime + stime), minor
    page faults."""

    cpu_s: float
    faults: int


def usage(pids: Sequence[int]) -> Usage:
    ticks = faults = 0
    for pid in pids:
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        faults += int(fields[7])  # minflt
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return Usage(ticks / TICK, faults)


def answers_equal(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def check(rounds: int, threads: str) -> None:
    """SystemExit for arguments the run cannot take, before anything starts."""
    if rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if threads != "auto" and not (threads.isdigit() and int(threads) >= 1):
        raise SystemExit(f"--threads must be a number of threads or auto, not {threads!r}")


def model_seconds(port: int) -> tuple[float, float]:
    """The server's model wall time so far and its runs (its Prometheus histogram)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return model_seconds_in(reply.read().decode())
