"""sigstop: one of three servers behind the balancer hung (SIGSTOP) under load, resumed later."""

from __future__ import annotations

import os
import signal
import time

from perf.bench import Bench, sleep_until
from perf.drive import collect, digits_bodies
from perf.faults.results import (
    Outcome,
    around,
    between,
    failure_times,
    first_ok_from,
    fmt_s,
    summarize,
)
from perf.faults.watch import Watch, back_in, out_of


def sigstop(bench: Bench) -> Outcome:
    outcome = Outcome("sigstop", "SIGSTOP one of 3 servers under load, SIGCONT it later")
    servers = bench.servers("sigstop", 3)
    balancer = bench.balancer([s.address for s in servers])
    watch = Watch(balancer.address)
    length = bench.seconds(16.0, 8.0)
    hold = bench.seconds(6.0, 3.0)
    t0 = time.monotonic() + 0.3
    futures = bench.load(
        balancer.address, concurrency=8, duration=length, start_at=t0, bodies=digits_bodies()
    )
    victim = servers[0]
    try:
        sleep_until(t0 + length * 0.25)
        t_stop = time.monotonic()
        bench.stopped.add(victim.pid)
        os.kill(victim.pid, signal.SIGSTOP)
        sleep_until(t_stop + hold)
        t_cont = time.monotonic()
        os.kill(victim.pid, signal.SIGCONT)
        bench.stopped.discard(victim.pid)
        records = collect(futures)
    finally:
        watch.stop()
    t_out = watch.first(t_stop, out_of(victim.address))
    t_in = watch.first(t_cont, back_in(victim.address))
    detect = t_stop + (t_out if t_out is not None else hold)
    end = t0 + length + 1
    outcome.rows = [
        *around(records, t0, t_stop),
        summarize("stop -> detected", between(records, t_stop, detect)),
        summarize("detected -> SIGCONT", between(records, detect, t_cont)),
        summarize("after SIGCONT", between(records, t_cont, end)),
        summarize("all", records),
    ]
    node = "sigstop-s0"
    outcome.facts["detection s (balancer Health: out)"] = t_out
    outcome.facts["calls begun while it was stopped that it answered"] = sum(
        r.node == node for r in between(records, t_stop, t_cont)
    )
    outcome.facts["back in s after SIGCONT"] = t_in
    outcome.facts["first reply from it s after SIGCONT"] = first_ok_from(records, node, t_cont)
    outcome.facts["its states"] = " > ".join(watch.states(victim.address))
    outcome.facts["failed calls began at"] = failure_times(records, t0)
    outcome.rss_mb = bench.rss()
    # Rows: before, in flight at the stop, stop -> detected, detected -> SIGCONT, ...
    before_detect = sum(sum(r.failures.values()) for r in outcome.rows[1:3])
    after_detect = sum(sum(r.failures.values()) for r in outcome.rows[3:5])
    outcome.goals = {
        "detected within 3 s": t_out is not None and t_out < 3,
        "after detection (and after SIGCONT): 0 failures": after_detect == 0,
        "back in within 3 s of SIGCONT": t_in is not None and t_in < 3,
    }
    outcome.headline = (
        f"out after {fmt_s(t_out)}; failures {before_detect} before detection, {after_detect} after"
    )
    return outcome
