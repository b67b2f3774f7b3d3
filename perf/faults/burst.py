"""burst: thousands of calls at once, at one server and through the balancer."""

from __future__ import annotations

import time
from collections import Counter

from perf.bench import Bench
from perf.drive import collect, digits_bodies
from perf.faults.results import Outcome, failures_text, summarize


def burst(bench: Bench) -> Outcome:
    calls = 600 if bench.quick else 2000
    outcome = Outcome("burst", f"{calls} calls at once, at one server and via the balancer")
    servers = bench.servers("burst", 2)
    balancer = bench.balancer([s.address for s in servers])
    rows = []
    for label, target in (("one server", servers[0].address), ("via balancer", balancer.address)):
        t0 = time.monotonic() + 0.5
        records = collect(
            bench.load(
                target,
                burst=True,
                total=calls,
                timeout=10.0,
                start_at=t0,
                bodies=digits_bodies(),
            )
        )
        finished = max((r.start + r.latency for r in records), default=t0) - t0
        rows.append(summarize(label, records, f"all done in {finished:.2f} s"))
    outcome.rows = rows
    outcome.rss_mb = bench.rss()
    statuses: Counter[str] = Counter()
    for r in rows:
        statuses.update(r.failures)
    outcome.goals = {
        "no CANCELLED": statuses["CANCELLED"] == 0,
        "no INTERNAL or UNKNOWN": statuses["INTERNAL"] + statuses["UNKNOWN"] == 0,
        "every call answered": all(r.calls == calls for r in rows),
    }
    outcome.headline = "; ".join(f"{r.name}: {r.ok} OK, {failures_text(r.failures)}" for r in rows)
    return outcome
