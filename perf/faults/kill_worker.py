"""kill-worker: one of two balancer workers killed under load, and its respawn."""

from __future__ import annotations

import os
import signal
import time

from perf.bench import Bench, sleep_until
from perf.drive import collect, digits_bodies
from perf.faults.results import Outcome, around, between, failure_times, fmt_s, summarize
from perf.launch import children


def kill_worker(bench: Bench) -> Outcome:
    outcome = Outcome("kill-worker", "kill -9 one of 2 balancer workers under load")
    servers = bench.servers("worker", 2)
    balancer = bench.balancer([s.address for s in servers], "--workers", "2")
    line = f"listening on {balancer.address}"

    def listening() -> int:
        return sum(line in text for text in list(balancer.lines))

    deadline = time.monotonic() + 30
    while (listening() < 2 or not children(balancer.pid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    before = children(balancer.pid)
    bench.workers.update(before)
    length = bench.seconds(10.0, 5.0)
    t0 = time.monotonic() + 0.3
    futures = bench.load(
        balancer.address,
        concurrency=8,
        duration=length,
        start_at=t0,
        connections=4,
        bodies=digits_bodies(),
    )
    sleep_until(t0 + length * 0.3)
    if not before:
        raise RuntimeError("the balancer started no worker:\n" + balancer.log())
    announced = listening()
    t_kill = time.monotonic()
    os.kill(before[0], signal.SIGKILL)
    respawn: float | None = None
    while time.monotonic() < t_kill + 15:
        now = children(balancer.pid)
        if any(p not in before for p in now) and listening() > announced:
            respawn = time.monotonic() - t_kill
            bench.workers.update(now)
            break
        time.sleep(0.01)
    records = collect(futures)
    end = t0 + length + 1
    outcome.rows = [
        *around(records, t0, t_kill),
        summarize("kill -> respawned", between(records, t_kill, t_kill + (respawn or 0))),
        summarize("after", between(records, t_kill + (respawn or 0), end)),
        summarize("all", records),
    ]
    failed = sum(r.status != "OK" for r in records)
    share = failed / len(records) if records else 0.0
    outcome.facts["respawned and listening after s"] = respawn
    outcome.facts["failed share"] = f"{share:.3%}"
    outcome.facts["worker killed at s"] = round(t_kill - t0, 2)
    outcome.facts["failed calls began at"] = failure_times(records, t0)
    outcome.facts["parent alive"] = balancer.proc.poll() is None
    outcome.rss_mb = bench.rss()
    outcome.goals = {
        "respawned within 2 s": respawn is not None and respawn < 2,
        "failed share < 0.5%": share < 0.005,
    }
    outcome.headline = f"respawn {fmt_s(respawn)}; failed {failed} ({share:.2%})"
    return outcome
