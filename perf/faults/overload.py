"""overload: open loop at 1.5x and 2x of the measured capacity with 100 ms deadlines, at a
server, a bounded server, a heavier model and the balancer."""

from __future__ import annotations

from collections import Counter

from perf.bench import Bench
from perf.drive import collect, collect_with_cpu, digits_bodies, mlp_bodies
from perf.faults.results import Outcome, percentile_ms, summarize
from sluice.client import SluiceClient
from sluice.perf.loadgen import Bodies

OVERLOAD_TIMEOUT = 0.1  # the overload scenario's deadline


LATE_SLACK = 0.01  # an OK reply seen later than this past its deadline counts as late


def node_errors(target: str) -> Counter[str]:
    """What the node at `target` has counted (its Health): calls begun ("calls"), errors by
    status, and for a server the batcher's refusals ("queue full") and expiries."""
    with SluiceClient(target, options=[("grpc.use_local_subchannel_pool", 1)]) as client:
        health = client.health(timeout=5)
    counts = Counter(dict(health.errors_by_code))
    counts["calls"] = health.requests
    if health.role == "server":
        counts["queue full"] = health.batcher.rejected
        counts["expired in queue"] = health.batcher.expired
    return counts


def overload_target(
    bench: Bench, label: str, target: str, bodies: Bodies, concurrency: int, outcome: Outcome
) -> None:
    capacity_s = bench.seconds(4.0, 2.0)
    level_s = bench.seconds(5.0, 2.0)
    warm = bench.load(
        target,
        concurrency=concurrency,
        duration=bench.seconds(1.5, 0.5),
        timeout=2.0,
        bodies=bodies,
    )
    collect(warm)  # not counted: first runs, connections, the EWMA
    records, cpu = collect_with_cpu(
        bench.load(target, concurrency=concurrency, duration=capacity_s, timeout=2.0, bodies=bodies)
    )
    ok = sum(r.status == "OK" for r in records)
    span = (
        (max(r.start + r.latency for r in records) - min(r.start for r in records))
        if records
        else 1.0
    )
    capacity = ok / span
    outcome.rows.append(
        summarize(
            f"{label}: closed c={concurrency}",
            records,
            f"capacity {capacity:.0f}/s; client cpu {cpu:.0%}",
        )
    )
    outcome.facts[f"{label}: capacity calls/s"] = round(capacity, 1)
    for factor in (1.5, 2.0):
        rate = capacity * factor
        before = node_errors(target)
        records, cpu = collect_with_cpu(
            bench.load(target, rate=rate, duration=level_s, timeout=OVERLOAD_TIMEOUT, bodies=bodies)
        )
        seen = node_errors(target) - before
        outcome.facts[f"{label}: what the node counted at {factor:g}x"] = dict(seen)
        ok_records = [r for r in records if r.status == "OK"]
        goodput = len(ok_records) / level_s
        # From the send, as grpc's deadline counts; the client's own lag to see a reply
        # is in it, so a little slack before calling it late.
        late = sum(r.wire > OVERLOAD_TIMEOUT + LATE_SLACK for r in ok_records)
        worst = max((r.wire for r in ok_records), default=0.0)
        lag = percentile_ms([r.latency - r.wire for r in records], 99) or 0.0
        ratio = goodput / capacity if capacity else 0.0
        note = (
            f"goodput {goodput:.0f}/s = {ratio:.0%} of capacity; OK past deadline {late} "
            f"(slowest OK {worst * 1000:.0f} ms); send lag p99 {lag:.0f} ms; client cpu {cpu:.0%}"
        )
        outcome.rows.append(summarize(f"{label}: open {factor:g}x ({rate:.0f}/s)", records, note))
        outcome.facts[f"{label}: goodput at {factor:g}x / capacity"] = round(ratio, 3)
        # grpc's own deadline ends any call unanswered in time, so an OK reply seen late is
        # the client's lag in reading it (send lag tells how busy the client was): reported,
        # not a goal.
        outcome.facts[f"{label}: OK replies seen past the deadline at {factor:g}x"] = late
        if factor == 2.0:
            outcome.goals[f"{label} 2x: goodput >= 50% of capacity"] = ratio >= 0.5


def pending_bound(capacity: float) -> int:
    """--max-pending-calls for a node of this capacity: what it serves in half a deadline."""
    return max(8, round(capacity * OVERLOAD_TIMEOUT / 2))


def overload(bench: Bench) -> Outcome:
    outcome = Outcome("overload", "open loop at 1.5x and 2x capacity, 100 ms deadlines")
    server = bench.server("overload-digits")
    overload_target(bench, "digits", server.address, digits_bodies(), 16, outcome)
    outcome.rss_mb.update(bench.rss())
    bench.stop("overload-digits")
    # grpc core's queue of calls not yet taken is where overload waits unseen: bounded.
    bound = pending_bound(outcome.facts["digits: capacity calls/s"])
    server = bench.server("overload-bounded", "--max-pending-calls", str(bound))
    label = f"digits pending<={bound}"
    overload_target(bench, label, server.address, digits_bodies(), 16, outcome)
    bench.stop("overload-bounded")
    from perf import make_mlp

    mlp = bench.server("overload-mlp", model=make_mlp.cached())
    overload_target(bench, "mlp4096", mlp.address, mlp_bodies(), 8, outcome)
    outcome.rss_mb.update(bench.rss())
    bench.stop("overload-mlp")
    servers = bench.servers("overload", 3)
    balancer = bench.balancer([s.address for s in servers])
    overload_target(bench, "balancer+3", balancer.address, digits_bodies(), 16, outcome)
    outcome.rss_mb.update(bench.rss())
    bench.stop("balancer")
    bound = pending_bound(outcome.facts["balancer+3: capacity calls/s"])
    balancer = bench.balancer([s.address for s in servers], "--max-pending-calls", str(bound))
    label = f"balancer+3 pending<={bound}"
    overload_target(bench, label, balancer.address, digits_bodies(), 16, outcome)
    outcome.headline = ", ".join(
        f"{k.split(':')[0]} {k.split('at ')[1].split(' ')[0]} {v:.0%}"
        for k, v in outcome.facts.items()
        if "goodput" in k
    )
    return outcome
