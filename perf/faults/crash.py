"""kill9 and sigterm: one of three servers behind the balancer killed (or drained) under
load, then restarted on its port."""

from __future__ import annotations

import signal
import time

from perf.bench import Bench, port_of, sleep_until, write_listing
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


def crash(bench: Bench, how: signal.Signals, name: str) -> Outcome:
    """Three servers behind the balancer under closed-loop load; one is killed (or drained)
    and a new process starts on its port."""
    outcome = Outcome(name, f"{how.name} one of 3 servers under load, then restart it")
    servers = bench.servers(name, 3)
    addresses = [s.address for s in servers]
    balancer = bench.balancer(addresses)
    watch = Watch(balancer.address)
    length = bench.seconds(16.0, 7.0)
    t0 = time.monotonic() + 0.3
    futures = bench.load(
        balancer.address, concurrency=8, duration=length, start_at=t0, bodies=digits_bodies()
    )
    victim = servers[0]
    node = f"{name}-s0"
    try:
        sleep_until(t0 + length * 0.2)
        t_fault = time.monotonic()
        victim.proc.send_signal(how)
        code = victim.proc.wait(timeout=30)
        t_exit = time.monotonic()
        victim.close()
        outcome.facts["exit code"] = code
        outcome.facts["process exited after s"] = t_exit - t_fault
        sleep_until(t_fault + length * 0.15)
        t_restart = time.monotonic()
        try:
            revived = bench.server(node, port=port_of(victim.address))
            outcome.facts["restarted on"] = "the same port"
        except RuntimeError as exc:  # the port is not free yet: a new one, as an orchestrator would
            outcome.facts["same port refused"] = str(exc).splitlines()[-1][:120]
            revived = bench.server(node)
            write_listing(bench.workdir / "balancer.backends", [revived.address, *addresses[1:]])
        outcome.facts["restart took s"] = time.monotonic() - t_restart
        records = collect(futures)
    finally:
        watch.stop()
    t_out = watch.first(t_fault, out_of(victim.address))
    t_in = watch.first(t_restart, back_in(revived.address))
    end = t0 + length + 1
    rows = around(records, t0, t_fault)
    if t_out is not None:
        rows.append(summarize("fault -> marked out", between(records, t_fault, t_fault + t_out)))
        rows.append(summarize("out -> restart", between(records, t_fault + t_out, t_restart)))
    else:
        rows.append(summarize("fault -> restart (never out)", between(records, t_fault, t_restart)))
    rows.append(summarize("after restart", between(records, t_restart, end)))
    rows.append(summarize("all", records))
    outcome.rows = rows
    outcome.facts["detection s (balancer Health: out)"] = t_out
    outcome.facts["calls begun after the fault that it answered"] = sum(
        r.node == node for r in between(records, t_fault, t_restart)
    )
    outcome.facts["back in s after restart (Health: SERVING/CLOSED)"] = t_in
    outcome.facts["first reply from it s after restart"] = first_ok_from(records, node, t_restart)
    outcome.facts["its states"] = " > ".join(watch.states(victim.address))
    outcome.facts["failed calls began at"] = failure_times(records, t0)
    outcome.rss_mb = bench.rss()
    failed = len(records) - sum(r.status == "OK" for r in records)
    outcome.goals = {
        "no failed call": failed == 0,
        "marked out within 3 s": t_out is not None and t_out < 3,
        "back in within 5 s of the restart": t_in is not None and t_in < 5,
    }
    outcome.headline = f"failed {failed}; out after {fmt_s(t_out)}, back in {fmt_s(t_in)}"
    return outcome


def kill9(bench: Bench) -> Outcome:
    return crash(bench, signal.SIGKILL, "kill9")


def sigterm(bench: Bench) -> Outcome:
    return crash(bench, signal.SIGTERM, "sigterm")
