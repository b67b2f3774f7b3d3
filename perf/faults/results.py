"""A fault scenario's outcome: rows of calls by phase, facts, goals met or missed, and the
tables printed for each scenario and for the whole run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perf.bench import table
from perf.drive import Record


@dataclass
class Row:
    name: str
    calls: int
    ok: int
    failures: dict[str, int]
    p50_ms: float | None
    p99_ms: float | None
    refused_p99_ms: float | None
    note: str = ""


@dataclass
class Outcome:
    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    rss_mb: dict[str, float] = field(default_factory=dict)
    goals: dict[str, bool] = field(default_factory=dict)
    headline: str = ""
    wall_s: float = 0.0
    error: str = ""


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


def summarize(name: str, records: Iterable[Record], note: str = "") -> Row:
    recs = list(records)
    statuses = Counter(r.status for r in recs)
    ok = [r.latency for r in recs if r.status == "OK"]
    # On the wire (from the actual send): the load generator's own lag is not the server's.
    refused = [r.wire for r in recs if r.status == "RESOURCE_EXHAUSTED"]
    return Row(
        name=name,
        calls=len(recs),
        ok=statuses["OK"],
        failures={k: v for k, v in sorted(statuses.items()) if k != "OK"},
        p50_ms=percentile_ms(ok, 50),
        p99_ms=percentile_ms(ok, 99),
        refused_p99_ms=percentile_ms(refused, 99),
        note=note,
    )


def between(records: Iterable[Record], start: float, end: float) -> list[Record]:
    return [r for r in records if start <= r.start < end]


def around(records: Sequence[Record], start: float, fault: float) -> list[Row]:
    """Rows for the calls begun before a fault: those done before it, those in flight."""
    begun = between(records, start, fault)
    return [
        summarize("before", [r for r in begun if r.start + r.latency <= fault]),
        summarize("in flight at the fault", [r for r in begun if r.start + r.latency > fault]),
    ]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def failures_text(failures: dict[str, int]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in failures.items()) or "0"


def render(outcome: Outcome) -> str:
    head = f"== {outcome.name}: {outcome.title} ({outcome.wall_s:.1f} s)"
    parts = [head]
    if outcome.rows:
        parts.append(
            table(
                [
                    "phase",
                    "calls",
                    "ok",
                    "failures by status",
                    "p50 ms",
                    "p99 ms",
                    "refused p99",
                    "",
                ],
                [
                    [
                        r.name,
                        str(r.calls),
                        str(r.ok),
                        failures_text(r.failures),
                        ms(r.p50_ms),
                        ms(r.p99_ms),
                        ms(r.refused_p99_ms),
                        r.note,
                    ]
                    for r in outcome.rows
                ],
            )
        )
    for key, value in outcome.facts.items():
        parts.append(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    if outcome.rss_mb:
        parts.append(
            "  RSS MB at end: " + ", ".join(f"{k} {v:.0f}" for k, v in outcome.rss_mb.items())
        )
    for goal, met in outcome.goals.items():
        parts.append(f"  goal {'met   ' if met else 'MISSED'}: {goal}")
    if outcome.error:
        parts.append(f"  ERROR: {outcome.error}")
    return "\n".join(parts)


def render_summary(outcomes: Sequence[Outcome]) -> str:
    rows = []
    for o in outcomes:
        total: Counter[str] = Counter()
        calls = 0
        # A row named "all" holds the others; the others are disjoint.
        counted = [r for r in o.rows if r.name == "all"] or o.rows
        for r in counted:
            calls += r.calls
            total.update(r.failures)
        missed = [g for g, met in o.goals.items() if not met]
        verdict = "ERROR" if o.error else (f"{len(missed)} missed" if missed else "all met")
        rows.append(
            [
                o.name,
                str(calls),
                str(total.total()),
                str(total["INTERNAL"]),
                str(total["CANCELLED"]),
                verdict,
                f"{o.wall_s:.0f}",
                o.headline,
            ]
        )
    headers = ["scenario", "calls", "failed", "INTERNAL", "CANCELLED", "goals", "wall s", "figures"]
    return "== summary\n" + table(headers, rows)


def first_ok_from(records: Sequence[Record], node: str, after: float) -> float | None:
    """Seconds from `after` to the first OK reply (by completion) from `node`."""
    done = [r.start + r.latency for r in records if r.node == node and r.status == "OK"]
    later = [t for t in done if t >= after]
    return min(later) - after if later else None


def failure_times(records: Sequence[Record], t0: float) -> str:
    """When the first failed calls began (s from the load's start) and their status."""
    failed = [f"{r.start - t0:.2f} s {r.status}" for r in records if r.status != "OK"]
    more = f" (+{len(failed) - 8} more)" if len(failed) > 8 else ""
    return ", ".join(failed[:8]) + more if failed else "none"


def fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"
