"""Two installs of Sluice side by side in one run: a change's before and after. Each install
runs its own server (cache off) and its own balancer in front of a second server of its
own; the same sweep goes to all four in rotating rounds, so drift hits each alike. Then
each target's CPU per call (utime + stime of its own process over the calls of one more
sweep at `--cpu-level` in flight, no warm-up), in rotating rounds too: the steadiest figure
when the load generator shares the cores.

  python -m perf.versions --before ../baseline/.venv/bin --rounds 3 --levels 1,32

`--before` and `--after` are the `bin` folders holding each install's `sluice-server` and
`sluice-balancer` (after: this one). Unique inputs, so every call runs the model.

  python -m perf.versions --before ../baseline/.venv/bin --blocking-client

times each install's blocking SluiceClient instead: sequential calls from its own Python
against one server, the installs taking turns.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from perf import paired
from perf.launch import BIN, cpu_seconds, running
from sluice.models import DIGITS, SAMPLES

KEYS = ("p50", "p99", "throughput")
# Run by each install's own Python: its SluiceClient (an older install names its package
# `client`), sequential cache-hit calls to one server; prints ms per call.
CLIENT_TIMING = """
import sys, time
try:
    from sluice import SluiceClient
except ImportError:
    from client import SluiceClient
import numpy as np
x = np.load(sys.argv[2])
with SluiceClient(sys.argv[1]) as client:
    for _ in range(200):
        client.predict({"input": x})
    started = time.perf_counter()
    for _ in range(3000):
        client.predict({"input": x})
    print((time.perf_counter() - started) / 3000 * 1e3)
"""


def blocking_client(folders: dict[str, Path], rounds: int) -> dict[str, Any]:
    """Median ms per call of each install's blocking client, and after / before."""
    times: dict[str, list[float]] = {name: [] for name in folders}
    server = [str(folders["after"] / "sluice-server"), "--model", str(DIGITS), "--port", "0"]
    with running([*server, "--device", "cpu"]) as target:
        for _ in range(rounds):
            for name, folder in folders.items():
                argv = [str(folder / "python"), "-c", CLIENT_TIMING, target.address]
                done = subprocess.run(
                    [*argv, str(SAMPLES / "digit-3.npy")], capture_output=True, text=True
                )
                times[name].append(float(done.stdout.strip().splitlines()[-1]))
    result = {name: statistics.median(t) for name, t in times.items()}
    return {"ms_per_call": result, "after_vs_before": result["after"] / result["before"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.versions", description=__doc__)
    parser.add_argument("--before", required=True, help="bin folder of the install to beat")
    parser.add_argument("--after", default=str(BIN), help="bin folder of the new install")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", default="3s", help="per level per round")
    parser.add_argument("--levels", default="1,32", help="concurrency: idle, then saturated")
    parser.add_argument(
        "--call", default="predict", choices=("predict", "stream"), help="the sweep's --call"
    )
    parser.add_argument(
        "--cpu-level", default="32", help="in flight while CPU per call is counted ('': skip)"
    )
    parser.add_argument("--blocking-client", action="store_true", help="time the clients")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.blocking_client:
        folders = {"before": Path(args.before), "after": Path(args.after)}
        timed = blocking_client(folders, args.rounds)
        timed["command"] = "python -m perf.versions " + " ".join(argv or sys.argv[1:])
        print(paired.save(timed, args.out))
        return 0
    # The model by path: an older install may not carry it as package data.
    server = ["--model", str(DIGITS), "--port", "0", "--device", "cpu", "--cache-entries", "0"]
    targets: dict[str, str] = {}
    pids: dict[str, int] = {}
    with ExitStack() as stack:
        for name, folder in (("before", Path(args.before)), ("after", Path(args.after))):
            direct = stack.enter_context(running([str(folder / "sluice-server"), *server]))
            behind = stack.enter_context(running([str(folder / "sluice-server"), *server]))
            balancer = stack.enter_context(
                running(
                    [str(folder / "sluice-balancer"), "--port", "0", "--backend", behind.address]
                )
            )
            targets[f"{name}-server"] = direct.address
            targets[f"{name}-balancer"] = balancer.address
            pids[f"{name}-server"], pids[f"{name}-balancer"] = direct.pid, balancer.pid
        runs = paired.rounds(
            targets,
            [
                *("-c", args.levels, "-z", args.duration, "--warmup", "1s", "--unique"),
                "--call",
                args.call,
            ],
            args.rounds,
            "versions",
        )
        cpu = cpu_rounds(targets, pids, args) if args.cpu_level else {}
    levels = args.levels.split(",")
    result: dict[str, Any] = {
        "command": "python -m perf.versions " + " ".join(argv or sys.argv[1:]),
    }
    for name, r in runs.items():
        result[name] = {
            f"c{c}": {k: paired.median(r, i, k) for k in KEYS} for i, c in enumerate(levels)
        }
        result[name]["errors"] = sum(lv["calls"] - lv["ok"] for run in r for lv in run["levels"])
    for kind in ("server", "balancer"):
        before, after = result[f"before-{kind}"], result[f"after-{kind}"]
        result[f"{kind}_after_vs_before"] = {
            f"c{c}": {k: after[f"c{c}"][k] / before[f"c{c}"][k] for k in KEYS} for c in levels
        }
    if cpu:
        result["cpu_us_per_call"] = cpu
        for kind in ("server", "balancer"):
            result[f"{kind}_cpu_after_vs_before"] = cpu[f"after-{kind}"] / cpu[f"before-{kind}"]
    result["saturated"] = paired.saturated(runs)
    print(markdown(result, levels))
    paired.save(result, args.out)
    return 0


def cpu_rounds(
    targets: dict[str, str], pids: dict[str, int], args: argparse.Namespace
) -> dict[str, float]:
    """Median over rounds of each target's own CPU microseconds per call (a balancer's alone,
    not its server's) in a sweep at `--cpu-level` in flight, the order rotating."""
    spent: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    sweep = ["-c", args.cpu_level, "-z", args.duration, "--warmup", "0s", "--unique"]
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            before = cpu_seconds([pids[name]])
            run = paired.sweep_once(targets[name], [*sweep, "--call", args.call])
            calls = sum(level["calls"] for level in run["levels"])
            spent[name].append((cpu_seconds([pids[name]]) - before) / max(calls, 1) * 1e6)
            print(f"versions cpu round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
    return {name: statistics.median(values) for name, values in spent.items()}


def markdown(result: dict[str, Any], levels: Sequence[str]) -> str:
    lines = [
        "| target | " + " | ".join(f"c={c} p50 ms | c={c} calls/s" for c in levels) + " |",
        "|---|" + "---:|---:|" * len(levels),
    ]
    for name in ("before-server", "after-server", "before-balancer", "after-balancer"):
        cells = [
            f"{result[name][f'c{c}']['p50']:.3f} | {result[name][f'c{c}']['throughput']:.0f}"
            for c in levels
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for kind in ("server", "balancer"):
        ratio = result[f"{kind}_after_vs_before"]
        cells = [
            f"{ratio[f'c{c}']['p50']:.2f}x | {ratio[f'c{c}']['throughput']:.2f}x" for c in levels
        ]
        lines.append(f"| {kind}: after / before | " + " | ".join(cells) + " |")
    if "cpu_us_per_call" in result:
        cpu = result["cpu_us_per_call"]
        lines.append("\n| target | CPU us per call |\n|---|---:|")
        lines += [f"| {name} | {cpu[name]:.0f} |" for name in cpu]
        for kind in ("server", "balancer"):
            lines.append(
                f"| {kind}: after / before | {result[f'{kind}_cpu_after_vs_before']:.2f}x |"
            )
    if result["saturated"]:
        lines.append("\n**Warning:** the load generator saturated in at least one level.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
