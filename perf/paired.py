"""Side-by-side measurement: the same sweep against several targets in alternating rounds,
so drift on a shared machine hits each alike; medians across rounds."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sluice.perf import sweep


def sweep_once(target: str, extra: Sequence[str]) -> dict[str, Any]:
    args = sweep.build_parser().parse_args(["--target", target, "--quiet", *extra])
    return sweep.sweep(args)


def rounds(
    targets: Mapping[str, str], extra: Sequence[str], count: int, label: str = ""
) -> dict[str, list[dict[str, Any]]]:
    """Each target swept `count` times, the order rotating every round."""
    return alternate({name: (target, ()) for name, target in targets.items()}, extra, count, label)


def alternate(
    configs: Mapping[str, tuple[str, Sequence[str]]],
    common: Sequence[str],
    count: int,
    label: str = "",
) -> dict[str, list[dict[str, Any]]]:
    """Each configuration (a target and its own sweep flags, after `common`) swept `count`
    times, the order rotating every round."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(count):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            target, extra = configs[name]
            runs[name].append(sweep_once(target, [*common, *extra]))
            print(f"{label} round {r + 1}/{count}: {name} done", file=sys.stderr)
    return runs


def summary(runs: Mapping[str, Sequence[dict[str, Any]]], levels: Sequence[str]) -> dict[str, Any]:
    """Per configuration: each level's median p50, p99 and throughput (as `c<level>`), and
    the failed calls over all rounds."""
    result: dict[str, Any] = {}
    for name, r in runs.items():
        result[name] = {
            f"c{c}": {k: median(r, i, k) for k in ("p50", "p99", "throughput")}
            for i, c in enumerate(levels)
        }
        result[name]["errors"] = sum(lv["calls"] - lv["ok"] for run in r for lv in run["levels"])
    return result


def median(runs: Sequence[dict[str, Any]], level: int, key: str) -> float:
    """Median over rounds of a level's latency percentile ('p50', 'p99', ...) or field."""
    values = [
        run["levels"][level]["latency"][key]
        if key in run["levels"][level]["latency"]
        else run["levels"][level][key]
        for run in runs
    ]
    return float(statistics.median(values))


def median_server(runs: Sequence[dict[str, Any]], level: int, key: str) -> float:
    values = [run["levels"][level]["server"].get(key, 0.0) for run in runs]
    return float(statistics.median(values))


def saturated(runs: Mapping[str, Sequence[dict[str, Any]]]) -> bool:
    return any(lv["client_saturated"] for rs in runs.values() for r in rs for lv in r["levels"])


def save(result: dict[str, Any], out: str) -> str:
    """The result as JSON text, also written to `out` when one is given."""
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    return text


def context(note: str) -> dict[str, Any]:
    """What a scenario's figures were measured on: the commit, the cores, the load average
    (1, 5 and 15 minutes) before it (`loadavg_rounds` for each round's, appended by the
    scenario), when it started, and the caller's note."""
    described = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return {
        "commit": described.stdout.strip() or "unknown",
        "cpus": os.cpu_count(),
        "loadavg_before": list(os.getloadavg()),
        "loadavg_rounds": [],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": note,
    }
