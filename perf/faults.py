"""`python -m perf.faults`: the fault suite. Each scenario starts real processes on
127.0.0.1 (servers on the CPU, a balancer), drives load from load-generator processes,
injects one fault, and prints one table; a summary table follows, and `--out` writes JSON.

  python -m perf.faults                       # every scenario, a few minutes
  python -m perf.faults --scenario sigstop --scenario burst
  python -m perf.faults --quick --out faults.json

Scenarios: kill9, sigterm, sigstop (a server killed, drained, hung and resumed behind the
balancer), failing-model (a server whose model fails every call), bad-flood (hostile calls
mixed with valid ones), slow-reader (a PredictStream caller that never reads), burst (2,000
calls at once), overload (open loop at 1.5x and 2x of capacity, 100 ms deadlines),
kill-worker (a balancer worker killed under load).

Every process is stopped by its pid when its scenario ends; every load loop is bounded in
calls and in time. Latency counts from a call's scheduled send time (open loop) or its send
(closed loop); a call's record keeps its start, so phases split on when calls began.
The sweep's load generator (`sluice.perf.loadgen`) keeps one histogram for all statuses;
these scenarios need latency by status and the node that answered each call, so the
driver here is a thin one over the same request bodies (`loadgen.Bodies`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np

from perf.launch import BIN, Process, children, server_argv
from sluice import models
from sluice.client import SluiceClient
from sluice.core.keys import PREDICT
from sluice.perf import loadgen
from sluice.perf.loadgen import Bodies
from sluice.perf.sweep import make_bodies
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

HOST_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]
STREAM = "/sluice.v1.Inference/PredictStream"
FAULT_TIMEOUT = 1.0  # the deadline of calls in the fault scenarios, seconds
OVERLOAD_TIMEOUT = 0.1  # the overload scenario's deadline
LATE_SLACK = 0.01  # an OK reply seen later than this past its deadline counts as late
LOAD_PROCS = 2  # load-generator processes


# ---------------------------------------------------------------- the load driver (children)


class Record(NamedTuple):
    """One call: when it was due (monotonic, comparable across processes on Linux), its
    latency from then and from its actual send, its status, the node that answered (from
    `x-node-id`), and the kind of hostile body it carried ("" for a valid call)."""

    start: float
    latency: float
    wire: float
    status: str
    node: str
    kind: str


@dataclass(frozen=True)
class Drive:
    """One load-generator process's share of a load: closed loop (`concurrency`), open
    loop (`rate`), or `burst` (all `total` calls at once). Bounded by `total` and
    `duration`."""

    target: str
    bodies: Bodies
    concurrency: int = 0
    rate: float = 0.0
    burst: bool = False
    total: int = 1_000_000
    duration: float = 5.0
    timeout: float = FAULT_TIMEOUT
    first_call: int = 0
    start_at: float = 0.0  # time.monotonic() to begin at, so processes begin together
    connections: int = 1
    hostile: tuple[tuple[str, bytes], ...] = ()
    hostile_share: float = 0.0
    seed: int = 0
    metadata: tuple[tuple[str, str], ...] = ()  # sent with every call (an API key)


async def drive(spec: Drive) -> list[Record]:
    channels = [
        grpc.aio.insecure_channel(spec.target, options=HOST_OPTIONS)
        for _ in range(spec.connections)
    ]
    stubs = [
        ch.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        for ch in channels
    ]
    records: list[Record] = []
    rng = random.Random(spec.seed)
    try:
        for ch in channels:
            with suppress(TimeoutError):
                await asyncio.wait_for(ch.channel_ready(), 10)

        async def one(k: int, due: float) -> None:
            kind = ""
            body = b""
            if spec.hostile and rng.random() < spec.hostile_share:
                kind, body = spec.hostile[k % len(spec.hostile)]
            else:
                body = spec.bodies.body(k)
            sent = time.monotonic()
            pending = stubs[k % len(stubs)](
                body, timeout=spec.timeout, metadata=spec.metadata or None
            )
            status = "OK"
            try:
                await pending
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
            except asyncio.CancelledError:
                raise
            except Exception:  # a client-side failure is a status too, never a lost record
                status = "CLIENT_ERROR"
            node = ""
            with suppress(Exception):
                trailers = await pending.trailing_metadata()
                node = str(dict(trailers or ()).get("x-node-id", ""))
            done = time.monotonic()
            records.append(Record(due, done - due, done - sent, status, node, kind))

        if spec.start_at:
            await asyncio.sleep(max(0.0, spec.start_at - time.monotonic()))
        start = time.monotonic()
        stop_at = start + spec.duration
        if spec.burst:
            await asyncio.gather(*(one(spec.first_call + i, start) for i in range(spec.total)))
        elif spec.rate:
            count = min(spec.total, max(1, int(spec.duration * spec.rate)))
            tasks: set[asyncio.Task[None]] = set()
            for i in range(count):
                due = start + i / spec.rate
                if (delay := due - time.monotonic()) > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one(spec.first_call + i, due))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        else:
            issued = 0

            async def worker() -> None:
                nonlocal issued
                while issued < spec.total and time.monotonic() < stop_at:
                    k = spec.first_call + issued
                    issued += 1
                    await one(k, time.monotonic())

            await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    finally:
        for ch in channels:
            await ch.close(grace=None)
    return records


def drive_in_process(spec: Drive) -> tuple[list[Record], float]:
    """Entry point of the load-generator processes: the records, and the share of one core
    this process used meanwhile (near 1: the client, not the target, was the limit)."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    cpu, wall = time.process_time(), time.monotonic()
    with asyncio.Runner(loop_factory=factory) as runner:
        records = runner.run(drive(spec))
    wall = time.monotonic() - max(wall, spec.start_at)
    return records, (time.process_time() - cpu) / wall if wall > 0 else 0.0


# ---------------------------------------------------------------- results and tables


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


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


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


# ---------------------------------------------------------------- processes


def rss_mb(pid: int) -> float | None:
    """VmRSS of `pid` in MB (Linux), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def port_of(address: str) -> str:
    return address.rpartition(":")[2]


class Bench:
    """What one scenario holds: its processes (each stopped by its pid at the end), the
    load-generator pool, a scratch folder, and the durations (`quick` shortens them)."""

    def __init__(self, pool: ProcessPoolExecutor, workdir: Path, quick: bool) -> None:
        self.pool = pool
        self.workdir = workdir
        self.quick = quick
        self.procs: dict[str, Process] = {}
        self.workers: set[int] = set()  # balancer workers seen: stopped by pid too
        self.stopped: set[int] = set()  # SIGSTOPped pids, resumed before they are killed

    def seconds(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def start(self, name: str, argv: Sequence[str]) -> Process:
        proc = Process(argv)
        self.procs[name] = proc
        proc.wait_serving()
        return proc

    def server(self, name: str, *extra: str, model: Path | None = None, port: str = "0") -> Process:
        argv = server_argv("--device", "cpu", *extra, "--port", port, node_id=name, model=model)
        return self.start(name, argv)

    def servers(self, prefix: str, count: int, *extra: str) -> list[Process]:
        """`count` servers started together (named prefix-s0, -s1, ...), once all serve."""
        started = []
        for i in range(count):
            name = f"{prefix}-s{i}"
            argv = server_argv("--device", "cpu", *extra, "--port", "0", node_id=name)
            self.procs[name] = proc = Process(argv)
            started.append(proc)
        for proc in started:
            proc.wait_serving()
        return started

    def balancer(self, backends: Sequence[str], *extra: str, name: str = "balancer") -> Process:
        listing = self.workdir / f"{name}.backends"
        write_listing(listing, backends)
        argv = [
            str(BIN / "sluice-balancer"),
            *("--port", "0", "--node-id", name),
            *("--backends-file", str(listing), "--refresh-s", "0.1"),
            *extra,
        ]
        proc = self.start(name, argv)
        # Faults are measured from a settled start: every backend known and SERVING.
        with SluiceClient(proc.address) as client:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                health = client.health(timeout=5)
                states = [b.health for b in health.backends]
                if len(states) == len(backends) and set(states) == {"SERVING"}:
                    break
                time.sleep(0.02)
        return proc

    def rss(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for name, proc in self.procs.items():
            if proc.proc.poll() is None and (mb := rss_mb(proc.pid)) is not None:
                found[name] = mb
                for i, pid in enumerate(children(proc.pid)):
                    self.workers.add(pid)
                    if (child := rss_mb(pid)) is not None:
                        found[f"{name}/worker{i + 1}"] = child
        return found

    def load(self, target: str, *, procs: int = LOAD_PROCS, **kwargs: Any) -> list[Future[Any]]:
        """Submit one load to `procs` load-generator processes; `concurrency`, `rate` and
        `total` are split among them. Starts 0.3 s from now in all of them at once."""
        concurrency = int(kwargs.pop("concurrency", 0))
        rate = float(kwargs.pop("rate", 0.0))
        total = int(kwargs.pop("total", 1_000_000))
        start_at = float(kwargs.pop("start_at", time.monotonic() + 0.3))
        base = random.randrange(10**6) * loadgen.SWEEP_STRIDE  # unique bodies stay unique
        specs = [
            Drive(
                target=target,
                concurrency=concurrency // procs + (i < concurrency % procs),
                rate=rate / procs,
                total=total // procs + (i < total % procs),
                first_call=base + i * loadgen.PROCESS_STRIDE,
                start_at=start_at,
                seed=base + i,
                **kwargs,
            )
            for i in range(procs)
        ]
        return [self.pool.submit(drive_in_process, s) for s in specs]

    def stop(self, name: str) -> None:
        """Stop one process by its pid (SIGKILL) and forget it."""
        self.procs.pop(name).kill()

    def stop_all(self) -> None:
        for pid in self.stopped:
            with suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        for proc in reversed(list(self.procs.values())):
            self.workers.update(children(proc.pid))
            with suppress(Exception):
                proc.kill()
        for pid in self.workers:  # a worker outlives its parent only briefly (PDEATHSIG)
            with suppress(OSError):
                if b"sluice" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def collect(futures: Sequence[Future[Any]], timeout: float = 120.0) -> list[Record]:
    return collect_with_cpu(futures, timeout)[0]


def collect_with_cpu(
    futures: Sequence[Future[Any]], timeout: float = 120.0
) -> tuple[list[Record], float]:
    """Every load process's records, by start, and the busiest one's share of a core."""
    done, pending = wait_futures(futures, timeout=timeout)
    if pending:
        raise RuntimeError(f"{len(pending)} load processes did not finish in {timeout:.0f} s")
    records: list[Record] = []
    busiest = 0.0
    for f in done:
        part, cpu = f.result()
        records.extend(part)
        busiest = max(busiest, cpu)
    return sorted(records), busiest


def write_listing(listing: Path, addresses: Sequence[str]) -> None:
    partial = listing.with_suffix(".partial")
    partial.write_text("".join(f"{a}\n" for a in addresses))
    os.replace(partial, listing)


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


BackendView = dict[str, tuple[str, str, int]]  # address -> (health, breaker, calls)


class Watch:
    """A balancer's Health every `interval`, in a thread of its own, each sample timed."""

    def __init__(self, address: str, interval: float = 0.05) -> None:
        self.address = address
        self.interval = interval
        self.samples: list[tuple[float, BackendView]] = []
        self.last: pb.HealthResponse | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with SluiceClient(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) as c:
            while not self._stop.wait(self.interval):
                try:
                    health = c.health(timeout=1.0)
                except grpc.RpcError:
                    continue
                view = {b.address: (b.health, b.breaker, int(b.calls)) for b in health.backends}
                self.samples.append((time.monotonic(), view))
                self.last = health

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def first(self, after: float, condition: Callable[[BackendView], bool]) -> float | None:
        """Seconds from `after` to the first sample that meets `condition`."""
        for at, view in list(self.samples):
            if at >= after and condition(view):
                return at - after
        return None

    def states(self, address: str) -> list[str]:
        """The backend's distinct health/breaker states in order."""
        seen: list[str] = []
        for _, view in list(self.samples):
            if address in view:
                state = f"{view[address][0]}/{view[address][1]}"
                if not seen or seen[-1] != state:
                    seen.append(state)
        return seen


def out_of(address: str) -> Callable[[BackendView], bool]:
    def condition(view: BackendView) -> bool:
        state = view.get(address)
        return state is None or state[0] != "SERVING" or state[1] == "OPEN"

    return condition


def back_in(address: str) -> Callable[[BackendView], bool]:
    def condition(view: BackendView) -> bool:
        state = view.get(address)
        return state is not None and state[0] == "SERVING" and state[1] == "CLOSED"

    return condition


def digits_bodies() -> Bodies:
    """The bundled digits samples, each call with values of its own (no cache answers)."""
    return make_bodies([s.input for s in models.samples()], "input", unique=True)


def mlp_bodies() -> Bodies:
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    return make_bodies([x], "input", unique=True)


def first_ok_from(records: Sequence[Record], node: str, after: float) -> float | None:
    """Seconds from `after` to the first OK reply (by completion) from `node`."""
    done = [r.start + r.latency for r in records if r.node == node and r.status == "OK"]
    later = [t for t in done if t >= after]
    return min(later) - after if later else None


# ---------------------------------------------------------------- scenarios


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


def failure_times(records: Sequence[Record], t0: float) -> str:
    """When the first failed calls began (s from the load's start) and their status."""
    failed = [f"{r.start - t0:.2f} s {r.status}" for r in records if r.status != "OK"]
    more = f" (+{len(failed) - 8} more)" if len(failed) > 8 else ""
    return ", ".join(failed[:8]) + more if failed else "none"


def fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def kill9(bench: Bench) -> Outcome:
    return crash(bench, signal.SIGKILL, "kill9")


def sigterm(bench: Bench) -> Outcome:
    return crash(bench, signal.SIGTERM, "sigterm")


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


def failing_model(path: Path) -> Path:
    """An ONNX model with the digits model's input whose run always fails: a Reshape of the
    [N, 64] input to [7, 5], which no N allows (ONNX Runtime refuses it at run time)."""
    from onnx import TensorProto, helper, numpy_helper

    shape = numpy_helper.from_array(np.array([7, 5], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["input", "shape"], ["probabilities"])],
        "always-fails",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [7, 5])],
        [shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def failing(bench: Bench) -> Outcome:
    outcome = Outcome("failing-model", "one of 3 servers fails every call (INTERNAL)")
    bad_model = failing_model(bench.workdir / "fails.onnx")
    servers = [
        bench.server("failing-s0", model=bad_model),
        *(bench.server(f"failing-s{i}") for i in (1, 2)),
    ]
    balancer = bench.balancer([s.address for s in servers])
    watch = Watch(balancer.address)
    length = bench.seconds(12.0, 5.0)
    t0 = time.monotonic() + 0.3
    futures = bench.load(
        balancer.address, concurrency=8, duration=length, start_at=t0, bodies=digits_bodies()
    )
    try:
        records = collect(futures)
    finally:
        watch.stop()
    bad = servers[0].address
    t_open = watch.first(t0, lambda view: view.get(bad, ("", "", 0))[1] == "OPEN")
    opened = t0 + t_open if t_open is not None else t0 + length + 1
    end = t0 + length + 1
    outcome.rows = [
        summarize("until breaker first OPEN", between(records, t0, opened)),
        summarize("after it opened", between(records, opened, end)),
        summarize("all", records),
    ]
    internal = sum(r.status == "INTERNAL" for r in records)
    share = internal / len(records) if records else 0.0
    outcome.facts["breaker first OPEN after s"] = t_open
    outcome.facts["INTERNAL reaching clients"] = f"{internal} ({share:.2%} of calls)"
    outcome.facts["its states"] = " > ".join(watch.states(bad))
    if watch.last is not None:
        for b in watch.last.backends:
            outcome.facts[f"backend {b.address}"] = (
                f"{b.health}/{b.breaker} calls {b.calls} failures {b.failures}"
            )
    outcome.rss_mb = bench.rss()
    after_open = sum(outcome.rows[1].failures.values())
    outcome.goals = {
        "breaker opens within 2 s": t_open is not None and t_open < 2,
        "INTERNAL under 1% of calls": share < 0.01,
        "healthy servers' calls all OK": all(
            r.status == "OK" for r in records if r.node and r.node != "failing-s0"
        ),
    }
    outcome.headline = (
        f"INTERNAL {internal} ({share:.2%}); open after {fmt_s(t_open)}; "
        f"{after_open} failed after it opened"
    )
    return outcome


def hostile_bodies() -> tuple[tuple[str, bytes], ...]:
    def request(*tensors: pb.Tensor) -> bytes:
        return pb.PredictRequest(inputs=list(tensors)).SerializeToString()

    garbage = np.random.default_rng(7).bytes(512)
    return (
        (
            "rank 65",
            request(pb.Tensor(name="input", datatype="FP32", shape=[1] * 65, raw_data=bytes(4))),
        ),
        (
            "wrong dtype",
            request(pb.Tensor(name="input", datatype="INT64", shape=[1, 64], raw_data=bytes(512))),
        ),
        ("garbage bytes", garbage),
        (
            "absurd shape",
            request(
                pb.Tensor(name="input", datatype="FP32", shape=[0, 2**62, 2**62], raw_data=bytes(4))
            ),
        ),
        ("wrong name", request(codec.encode("nope", np.zeros((1, 64), np.float32)))),
    )


def bad_flood(bench: Bench) -> Outcome:
    outcome = Outcome("bad-flood", "10% hostile calls mixed into valid ones, via the balancer")
    count = 2 if bench.quick else 3
    servers = bench.servers("flood", count)
    balancer = bench.balancer([s.address for s in servers])
    length = bench.seconds(8.0, 3.0)
    futures = bench.load(
        balancer.address,
        concurrency=8,
        duration=length,
        bodies=digits_bodies(),
        hostile=hostile_bodies(),
        hostile_share=0.1,
    )
    records = collect(futures)
    valid = [r for r in records if not r.kind]
    rows = [summarize("valid calls", valid)]
    for kind, _ in hostile_bodies():
        rows.append(summarize(f"hostile: {kind}", [r for r in records if r.kind == kind]))
    outcome.rows = rows
    refused = sum(r.status != "OK" for r in valid)
    hostile = [r for r in records if r.kind]
    with SluiceClient(balancer.address) as client:
        health = client.health(timeout=5)
    internal_seen = dict(health.errors_by_code).get("INTERNAL", 0)
    for s in servers:
        with SluiceClient(s.address) as client:
            internal_seen += dict(client.health(timeout=5).errors_by_code).get("INTERNAL", 0)
    breakers = [f"{b.breaker}/{b.failures}" for b in health.backends]
    outcome.facts["valid calls refused"] = refused
    if refused:
        first = records[0].start
        outcome.facts["valid calls refused (s from start, latency s, status)"] = [
            (round(r.start - first, 3), round(r.latency, 3), r.status)
            for r in valid
            if r.status != "OK"
        ][:10]
    outcome.facts["hostile calls by status"] = dict(Counter(r.status for r in hostile))
    outcome.facts["breakers (state/failures)"] = ", ".join(breakers)
    outcome.facts["INTERNAL counted by the nodes"] = internal_seen
    outcome.rss_mb = bench.rss()
    outcome.goals = {
        "valid calls refused: 0": refused == 0,
        "every hostile call INVALID_ARGUMENT": all(r.status == "INVALID_ARGUMENT" for r in hostile),
        "no breaker opened, no failure counted": all(
            b.breaker == "CLOSED" and b.failures == 0 for b in health.backends
        ),
        "no INTERNAL anywhere": internal_seen == 0,
    }
    outcome.headline = (
        f"valid refused {refused}; hostile {dict(Counter(r.status for r in hostile))}"
    )
    return outcome


async def slow_read(address: str, body: bytes, until: float, stats: dict[str, Any]) -> None:
    """Write stream messages and never read a reply, until `until` (or 20,000 messages)."""
    options = [("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        method = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
        call = method(None)
        stats["written"] = 0

        async def write() -> None:
            for i in range(1, 20_001):
                message = pb.StreamRequest(id=i, request=body, timeout_s=60)
                await call.write(message.SerializeToString())
                stats["written"] = i
                stats["last_write"] = time.monotonic()

        writer = asyncio.create_task(write())
        try:
            await asyncio.wait_for(asyncio.shield(writer), max(0.0, until - time.monotonic()))
        except TimeoutError:
            pass
        except grpc.aio.AioRpcError as exc:
            stats["error"] = exc.code().name
        finally:
            writer.cancel()
            call.cancel()
            with suppress(BaseException):
                await writer


def slow_reader(bench: Bench) -> Outcome:
    outcome = Outcome("slow-reader", "PredictStream callers that write and never read")
    server = bench.server("slow-s0")
    balancer = bench.balancer([server.address])
    x = np.random.default_rng(5).uniform(0, 16, (32, 64)).astype(np.float32)
    body = pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString()
    window = bench.seconds(10.0, 4.0)
    pids = {"server": server.pid, "balancer": balancer.pid}
    before = {k: rss_mb(p) or 0.0 for k, p in pids.items()}
    peak = dict(before)
    t0 = time.monotonic() + 0.3
    until = t0 + window
    # Valid calls from others while the readers stall: do they still get through?
    futures = bench.load(
        balancer.address, concurrency=2, duration=window, start_at=t0, bodies=digits_bodies()
    )
    stats: dict[str, dict[str, Any]] = {"server": {}, "balancer": {}}

    async def both() -> None:
        await asyncio.gather(
            slow_read(server.address, body, until, stats["server"]),
            slow_read(balancer.address, body, until, stats["balancer"]),
        )

    runner = threading.Thread(target=lambda: asyncio.run(both()), daemon=True)
    sleep_until(t0)
    runner.start()
    while runner.is_alive() and time.monotonic() < until + 10:
        for k, p in pids.items():
            peak[k] = max(peak[k], rss_mb(p) or 0.0)
        runner.join(timeout=0.25)
    at_end = {k: rss_mb(p) or 0.0 for k, p in pids.items()}
    records = collect(futures)
    outcome.rows = [summarize("others' calls via balancer", records)]
    time.sleep(1.0)  # the readers are gone: memory held for them should be released
    released = {k: rss_mb(p) or 0.0 for k, p in pids.items()}
    for k in pids:
        s = stats[k]
        stall = s.get("last_write", t0) - t0
        outcome.facts[f"{k}: messages taken before the stall"] = (
            f"{s.get('written', 0)} (last write {stall:.1f} s in; {s.get('error', 'no error')})"
        )
        outcome.facts[f"{k}: RSS MB before / peak / end / 1 s later"] = (
            f"{before[k]:.0f} / {peak[k]:.0f} / {at_end[k]:.0f} / {released[k]:.0f}"
        )
    growth = {k: peak[k] - before[k] for k in pids}
    outcome.rss_mb = bench.rss()
    outcome.goals = {
        "server RSS growth < 50 MB": growth["server"] < 50,
        "balancer RSS growth < 50 MB": growth["balancer"] < 50,
        "others' calls all OK": all(r.status == "OK" for r in records),
        "writers held back (< 20,000 messages taken)": all(
            stats[k].get("written", 0) < 20_000 for k in pids
        ),
    }
    outcome.headline = (
        f"RSS growth server {growth['server']:.0f} MB, balancer {growth['balancer']:.0f} MB"
    )
    return outcome


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


SCENARIOS: dict[str, Callable[[Bench], Outcome]] = {
    "kill9": kill9,
    "sigterm": sigterm,
    "sigstop": sigstop,
    "failing-model": failing,
    "bad-flood": bad_flood,
    "slow-reader": slow_reader,
    "burst": burst,
    "overload": overload,
    "kill-worker": kill_worker,
}


def run_one(name: str, pool: ProcessPoolExecutor, quick: bool) -> Outcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"sluice-faults-{name}-") as scratch:
        bench = Bench(pool, Path(scratch), quick)
        try:
            outcome = SCENARIOS[name](bench)
        except Exception as exc:  # one scenario's failure is reported; the others still run
            outcome = Outcome(name, "did not complete", error=f"{type(exc).__name__}: {exc}")
            logs = [f"--- {n}\n{p.log()[-2000:]}" for n, p in bench.procs.items()]
            outcome.facts["logs"] = "\n".join(logs)
        finally:
            bench.stop_all()
    outcome.wall_s = time.monotonic() - started
    return outcome


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf.faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenario", action="append", choices=list(SCENARIOS), help="repeatable; default all"
    )
    p.add_argument("--quick", action="store_true", help="shorter loads (for tests)")
    p.add_argument("--out", default="", help="write the results as JSON to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    outcomes = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=LOAD_PROCS, mp_context=context) as pool:
        list(pool.map(loadgen.ready, [0.2] * LOAD_PROCS))  # start them all before any load
        for name in names:
            outcome = run_one(name, pool, args.quick)
            outcomes.append(outcome)
            print(render(outcome), flush=True)
            print(flush=True)
    print(render_summary(outcomes), flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "command": " ".join(["python -m perf.faults", *(argv or sys.argv[1:])]),
                    "quick": args.quick,
                    "cpus": os.cpu_count(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "scenarios": [asdict(o) for o in outcomes],
                },
                indent=2,
                default=str,
            )
        )
        print(f"wrote {args.out}")
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
