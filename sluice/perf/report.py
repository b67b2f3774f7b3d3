"""Sweep output: the live table on the terminal, and JSON, CSV, Markdown and PNG files."""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

COLUMNS = (
    ("level", 12),
    ("calls", 8),
    ("calls/s", 9),
    ("errors", 7),
    ("min ms", 8),
    ("p50 ms", 8),
    ("p90 ms", 8),
    ("p99 ms", 8),
    ("p99.9 ms", 9),
    ("max ms", 8),
    ("client cpu", 11),
    ("server", 24),
)
TARGET_COLUMN = ("target cpu/call", 22)  # unless --target-cpu off


def columns(with_target: bool) -> tuple[tuple[str, int], ...]:
    return (*COLUMNS, TARGET_COLUMN) if with_target else COLUMNS


def shows_target(result: dict[str, Any]) -> bool:
    """Whether the sweep measured the target's CPU (results from before it did not)."""
    return str(result.get("target_cpu", "off")) != "off"


def _cells(level: Any, with_target: bool = False) -> list[str]:
    lat = level["latency"] if isinstance(level, dict) else vars(level["latency"])
    value = level["value"]
    name = f"c={value:g}" if level["mode"] == "concurrency" else f"{value:g}/s"
    errors = str(level["calls"] - level["ok"])
    failed = {k: v for k, v in level["statuses"].items() if k != "OK"}
    if failed:
        errors += " (" + ", ".join(f"{k}:{v}" for k, v in sorted(failed.items())) + ")"
    cpu = f"{level['client_cpu']:.0%}" + (" SAT" if level["client_saturated"] else "")
    return [
        name,
        str(level["calls"]),
        f"{level['throughput']:.0f}",
        errors,
        f"{lat['min']:.3f}",
        f"{lat['p50']:.3f}",
        f"{lat['p90']:.3f}",
        f"{lat['p99']:.3f}",
        f"{lat['p999']:.3f}",
        f"{lat['max']:.3f}",
        cpu,
        _server_cell(level["server"]),
        *([_target_cell(level.get("target_cpu", {}))] if with_target else []),
    ]


def _target_cell(cpu: dict[str, Any]) -> str:
    """The target's CPU per call and the cores it kept busy ('-': not measured, and a
    warning says why)."""
    if cpu.get("per_call_ms") is None:
        return "-"
    cores = "-" if cpu.get("cores") is None else f"{cpu['cores']:.2f}"  # a level of no wall time
    return f"{cpu['per_call_ms']:.3f} ms, {cores} cores"


def _server_cell(server: dict[str, float]) -> str:
    parts = []
    if "mean_batch" in server:
        parts.append(f"batch {server['mean_batch']:.1f}")
        parts.append(f"queue<={server['queue_depth_max']:.0f}")
    if "cache_hit_rate" in server:
        parts.append(f"hits {server['cache_hit_rate']:.0%}")
    return " ".join(parts) or "-"


def live_header(with_target: bool = False) -> None:
    print("  ".join(name.rjust(width) for name, width in columns(with_target)), flush=True)


def live_row(level: Any, with_target: bool = False) -> None:
    row = _cells(asdict(level), with_target)
    _clear_progress()
    shown = zip(row, columns(with_target), strict=True)
    print("  ".join(c.rjust(w) for c, (_, w) in shown), flush=True)


def progress(mode: str, value: float, elapsed: float, expected: float) -> None:
    if not sys.stderr.isatty():
        return
    name = f"c={value:g}" if mode == "concurrency" else f"{value:g}/s"
    share = f" of ~{expected:.0f}s" if expected else ""
    sys.stderr.write(f"\r  running {name}: {elapsed:.1f}s{share} ")
    sys.stderr.flush()


def _clear_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r" + " " * 60 + "\r")


def live_footer(result: dict[str, Any]) -> None:
    knee = result["knee"]
    if knee is None:
        print("knee: not reached (p99 never doubled and throughput kept growing)")
    else:
        print(f"knee: {_cells(result['levels'][knee])[0]}")


def markdown(result: dict[str, Any]) -> str:
    with_target = shows_target(result)
    shown = columns(with_target)
    lines = [
        f"### {result['title']}",
        "",
        f"`{result['command']}`",
        "",
        "| " + " | ".join(name for name, _ in shown) + " |",
        "|" + "---:|" * len(shown),
    ]
    for i, level in enumerate(result["levels"]):
        cells = _cells(level, with_target)
        if i == result["knee"]:
            cells[0] += " (knee)"
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"**Warning:** {w}" for w in result["warnings"])]
    return "\n".join(lines).rstrip() + "\n"


def write_csv(result: dict[str, Any], path: Path) -> None:
    server_keys = sorted({k for lv in result["levels"] for k in lv["server"]})
    latency_keys = ["min", "p50", "p90", "p99", "p999", "max", "mean"]
    header = ["mode", "value", "calls", "ok", "throughput", "goodput", "client_cpu"]
    header += [f"{k}_ms" for k in latency_keys] + ["statuses"]
    header += ["target_cpu_ms_per_call", "target_cores"] + [f"server_{k}" for k in server_keys]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for lv in result["levels"]:
            writer.writerow(
                [lv[k] for k in header[:7]]
                + [lv["latency"][k] for k in latency_keys]
                + [json.dumps(lv["statuses"], sort_keys=True)]
                + [_blank(lv.get("target_cpu", {}).get(k)) for k in ("per_call_ms", "cores")]
                + [lv["server"].get(k, "") for k in server_keys]
            )


def _blank(value: object) -> object:
    return "" if value is None else value


PNG_EXTRA = "pip install 'sluice[perf]'"
_png_note_shown = False


def png_available() -> bool:
    """Whether matplotlib (the `perf` extra) is installed; says once what to install if not."""
    global _png_note_shown
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if not _png_note_shown:
            _png_note_shown = True
            print(
                f"note: no PNG plot: matplotlib is not installed; for plots, {PNG_EXTRA}",
                file=sys.stderr,
            )
        return False
    return True


def write_png(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    x = [lv["value"] for lv in levels]
    fig, left = plt.subplots(figsize=(8, 4.5), dpi=100)
    left.plot(x, [lv["throughput"] for lv in levels], "o-", color="tab:blue", label="calls/s")
    left.set_ylabel("calls/s", color="tab:blue")
    modes = {lv["mode"] for lv in levels}
    left.set_xlabel("concurrency" if modes == {"concurrency"} else "level (concurrency or calls/s)")
    if len(x) > 1 and min(x) > 0 and max(x) / min(x) >= 8:
        left.set_xscale("log", base=2)
    right = left.twinx()
    right.plot(x, [lv["latency"]["p50"] for lv in levels], "s--", color="tab:green", label="p50")
    right.plot(x, [lv["latency"]["p99"] for lv in levels], "^--", color="tab:red", label="p99")
    right.set_ylabel("latency ms")
    right.set_ylim(bottom=0)
    left.set_ylim(bottom=0)
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    left.legend(handles, ["calls/s", "p50 ms", "p99 ms"], loc="upper left")
    left.set_title(result["title"])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_all(result: dict[str, Any], out: Path) -> list[Path]:
    """OUT.json, OUT.csv, OUT.md and, with matplotlib installed, OUT.png (OUT may name a
    folder: OUT/sweep.*). Returns the paths written."""
    if out.is_dir():
        out = out / "sweep"
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(s) for s in (".json", ".csv", ".md")]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    write_csv(result, paths[1])
    paths[2].write_text(markdown(result))
    if png_available():
        paths.append(out.with_suffix(".png"))
        write_png(result, paths[-1])
    return paths
