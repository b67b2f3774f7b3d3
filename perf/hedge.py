"""A replica that pauses now and then, behind the balancer, without and with hedged requests.
One command:

  python -m perf.hedge --rounds 3 --duration 5s --out docs/results/hedge.json

Processes, all on this host (127.0.0.1): three sluice-server on the bundled digits model
(CPU, one worker, cache off), and one balancer over them per configuration, each started
with its own flags:
  (a) healthy:    no server paused, no hedging;
  (b) paused:     one server paused (SIGSTOP/SIGCONT, --pause-ms of every --period-ms), no
                  hedging;
  (c) hedge-5ms:  paused, the balancer with --hedge-after-ms 5;
  (d) hedge-auto: paused, --hedge-after-ms auto;
  (e) overload:   paused, open loop at --overload x the measured capacity with
                  --overload-timeout deadlines, without and with --hedge-after-ms 5: the
                  extra upstream calls there show whether the budget stops hedges.
(c), (d) and the hedged overload need a balancer that has --hedge-after-ms; without it they
are reported as not run.

Load: --callers asyncio callers in this process, each on its own channel and a fixed
schedule (open loop: a call's latency counts from when it was due, so a pause shows in
every call it delays), together --load x the capacity (a closed loop of 16 against the
healthy balancer, measured first) unless --rate is given. The pause schedule runs on its own
thread and always ends with SIGCONT, also on error. Each window follows --warmup of the same
load, paused where the window is: uncounted, so the figures are of a replica that has been
pausing for a while (a balancer idle between windows refills its hedge budget's bank; what
the warmup spent of it is reported as warmup_extra_upstream).

Inputs: --inputs varied digit images cycled through, and the servers' result cache off, so
every call runs the model and no cache hides the pause; every OK answer is compared with
ONNX Runtime's own on the same input (equal within 1e-5 relative).

Columns: latency percentiles of the OK calls of all rounds pooled (and p99.9's median over
rounds); calls and failed calls; the calls the balancer took in (its Health's requests);
extra upstream calls = the attempts the balancer sent (its Health, backends' calls summed,
over the window) over the calls it took in, minus 1 (hedges and retries alike); the
balancer's hedge counters where its Health has them (and below the table, hedges per pause
beside the calls due in a pause, and the hedge delay in use at each window's end); CPU per
call of the balancer and the three servers (utime + stime from /proc over the window).
Calls slower than --slow-ms are broken down: begun while the server was paused, answered by
the paused server. The order of the steady configurations rotates every round."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import grpc
import numpy as np

from perf import paired
from perf.bench import table, write_listing
from perf.launch import BIN, Process, children, cpu_seconds, running, server_argv
from sluice import models
from sluice.client import AsyncSluiceClient
from sluice.core.keys import PREDICT
from sluice.perf.sweep import duration
from sluice.runtime.process import event_loop
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

SERVERS = 3
INPUT = "input"
CAPACITY_CALLERS = 16  # the closed loop that measures capacity
CAPACITY_S = 2.0
STEADY = ("healthy", "paused", "hedge-5ms", "hedge-auto")
OVERLOAD = ("overload", "overload-hedge-5ms")
HEDGE = {"hedge-5ms": "5", "hedge-auto": "auto", "overload-hedge-5ms": "5"}
PAUSED = {"paused", "hedge-5ms", "hedge-auto", *OVERLOAD}
LABELS = {
    "healthy": "(a) no server paused",
    "paused": "(b) paused, no hedging",
    "hedge-5ms": "(c) paused, --hedge-after-ms 5",
    "hedge-auto": "(d) paused, --hedge-after-ms auto",
    "overload": "(e0) paused, overload, no hedging",
    "overload-hedge-5ms": "(e) paused, overload, --hedge-after-ms 5",
}
HOST_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]
RTOL, ATOL = 1e-5, 1e-6


class Pauser:
    """Pauses processes (SIGSTOP) for `pause_s` of every `period_s` on its own thread, by
    pid, until stopped; SIGCONT always ends it. `spans` are the (stop, cont) monotonic
    times, for telling which calls began during a pause."""

    def __init__(self, pids: Sequence[int], pause_s: float, period_s: float) -> None:
        self.pids = list(pids)
        self.pause_s, self.period_s = pause_s, period_s
        self.spans: list[tuple[float, float]] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._done.clear()
        self._thread = threading.Thread(target=self._run, name="pauser", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._signal(signal.SIGCONT)  # whatever the thread managed: never left stopped

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _run(self) -> None:
        # On a loaded machine a late SIGCONT stretches the pause; raised where allowed.
        with suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        beat = time.monotonic()  # a fixed schedule: a late wake-up does not shift the rest
        try:
            while not self._done.is_set():
                self._signal(signal.SIGSTOP)
                stopped = time.monotonic()
                self._done.wait(max(0.0, beat + self.pause_s - stopped))
                self._signal(signal.SIGCONT)
                self.spans.append((stopped, time.monotonic()))
                beat += self.period_s
                self._done.wait(max(0.0, beat - time.monotonic()))
        finally:
            self._signal(signal.SIGCONT)

    def paused_at(self, moment: float) -> bool:
        return any(a <= moment < b for a, b in self.spans)

    def stopped_share(self, start: float, end: float) -> float:
        inside = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.spans)
        return inside / (end - start) if end > start else 0.0

    def count(self, start: float, end: float) -> int:
        return sum(start <= a < end for a, _ in self.spans)

    def longest_s(self, start: float, end: float) -> float:
        """The longest pause that began in the window: a late SIGCONT stretches one."""
        return max((b - a for a, b in self.spans if start <= a < end), default=0.0)


@dataclass(slots=True)
class Call:
    """One call: its number (which input), when it was due, its latency from then, its
    status, the node that answered and the reply's bytes (None unless OK)."""

    k: int
    due: float
    latency: float
    status: str
    node: str
    reply: bytes | None


@dataclass
class Inputs:
    """The varied inputs, their bodies, and ONNX Runtime's answers to them."""

    arrays: list[np.ndarray]
    bodies: list[bytes]
    want: list[dict[str, np.ndarray]]


def make_inputs(count: int, seed: int) -> Inputs:
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    samples = [s.input for s in models.samples()]
    arrays = [
        (samples[i % len(samples)] + rng.normal(0, 0.5, samples[0].shape)).astype(np.float32)
        for i in range(count)
    ]
    session = ort.InferenceSession(str(models.DIGITS), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    want = [dict(zip(names, session.run(None, {INPUT: a}), strict=True)) for a in arrays]
    return Inputs(arrays, [codec.encode_predict({INPUT: a}) for a in arrays], want)


def equal(reply: bytes, want: Mapping[str, np.ndarray]) -> bool:
    got = codec.decode_all(pb.PredictResponse.FromString(reply).outputs)
    return got.keys() == want.keys() and all(
        np.allclose(got[n], want[n], rtol=RTOL, atol=ATOL) for n in want
    )


async def drive(
    address: str,
    bodies: Sequence[bytes],
    *,
    rate: float,
    callers: int,
    seconds: float,
    timeout: float,
    first: int = 0,
) -> tuple[list[Call], float]:
    """`rate` calls/s for `seconds` from `callers` callers, each on its own channel, call i
    due at start + i/rate (open loop, bounded: rate x seconds calls). The calls, and the
    client's send lag p99 in seconds (how late it sent calls: its own load)."""
    channels = [grpc.aio.insecure_channel(address, options=HOST_OPTIONS) for _ in range(callers)]
    stubs = [
        ch.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        for ch in channels
    ]
    calls: list[Call] = []
    lags: list[float] = []
    try:
        for ch in channels:
            await asyncio.wait_for(ch.channel_ready(), 10)

        async def one(k: int, due: float) -> None:
            lags.append(time.monotonic() - due)
            pending = stubs[k % callers](bodies[k % len(bodies)], timeout=timeout)
            status, reply, node = "OK", None, ""
            try:
                reply = await pending
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
            with suppress(grpc.aio.AioRpcError):
                node = str(dict(await pending.trailing_metadata() or ()).get("x-node-id", ""))
            calls.append(Call(k, due, time.monotonic() - due, status, node, reply))

        async def caller(c: int, start: float, count: int) -> None:
            tasks = []
            for i in range(c, count, callers):
                due = start + i / rate
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(first + i, due)))
            await asyncio.gather(*tasks)

        start = time.monotonic() + 0.05
        count = max(1, int(rate * seconds))
        await asyncio.gather(*(caller(c, start, count) for c in range(callers)))
    finally:
        for ch in channels:
            await ch.close(grace=None)
    lag = float(np.percentile(lags, 99)) if lags else 0.0
    return sorted(calls, key=lambda c: c.due), lag


async def capacity(address: str, bodies: Sequence[bytes], seconds: float) -> float:
    """OK calls/s of a closed loop of CAPACITY_CALLERS callers against `address`."""
    ok = 0
    async with AsyncSluiceClient(address, timeout=5.0) as client:
        end = time.monotonic() + seconds
        started = time.monotonic()

        async def caller(c: int) -> None:
            nonlocal ok
            k = c
            while time.monotonic() < end:
                reply = await client.call_raw(bodies[k % len(bodies)], timeout=5.0)
                ok += reply.code == 0
                k += CAPACITY_CALLERS

        await asyncio.gather(*(caller(c) for c in range(CAPACITY_CALLERS)))
        return ok / (time.monotonic() - started)


@dataclass
class Counters:
    """What a balancer's Health says about its upstream attempts, and the CPU so far of
    the balancer and the servers."""

    received: int  # calls the balancer took in (its own count: at overload, fewer than sent)
    attempts: int
    hedges: dict[str, int]
    cpu_s: float
    after_ms: float = 0.0  # the hedge delay in use (a gauge: auto's moves), as last read

    def minus(self, before: Counters) -> Counters:
        hedges = {k: v - before.hedges.get(k, 0) for k, v in self.hedges.items()}
        return Counters(
            self.received - before.received,
            self.attempts - before.attempts,
            hedges,
            self.cpu_s - before.cpu_s,
            self.after_ms,
        )


async def counters(balancer: Process, servers: Sequence[Process]) -> Counters:
    async with AsyncSluiceClient(balancer.address, timeout=5.0) as client:
        health = await client.health()
    stats = health.balancer
    # The hedge counters where this balancer has them (hedge_after_ms is a gauge, not one).
    names = [f.name for f in stats.DESCRIPTOR.fields if f.name.startswith("hedges")]
    hedges = {n: int(getattr(stats, n)) for n in names}
    pids = [balancer.pid, *(s.pid for s in servers)]
    attempts = sum(b.calls for b in health.backends)
    after_ms = float(getattr(stats, "hedge_after_ms", 0.0))
    return Counters(health.requests, attempts, hedges, cpu_seconds(pids), after_ms)


@dataclass
class Window:
    """One configuration's measured window in one round."""

    calls: list[Call]
    counted: Counters
    seconds: float
    send_lag_s: float
    stopped_share: float  # of the window the paused server was stopped
    longest_pause_s: float
    pauses: int
    warmup_extra: float  # extra upstream calls in the warmup, the bank spent


async def window(
    balancer: Process,
    servers: Sequence[Process],
    bodies: Sequence[bytes],
    pauser: Pauser | None,
    *,
    rate: float,
    callers: int,
    seconds: float,
    timeout: float,
    warmup: float,
    first: int,
) -> Window:
    if pauser is not None:
        pauser.start()
    try:
        # Not counted: connections, latency estimates, and the budget's bank, which a
        # balancer idle between windows refills; the window is a replica pausing for a while.
        idle = await counters(balancer, servers)
        warm, _ = await drive(
            balancer.address, bodies, rate=rate, callers=callers, seconds=warmup, timeout=timeout
        )
        before = await counters(balancer, servers)
        started = time.monotonic()
        calls, lag = await drive(
            balancer.address,
            bodies,
            rate=rate,
            callers=callers,
            seconds=seconds,
            timeout=timeout,
            first=first,
        )
        ended = time.monotonic()
        after = await counters(balancer, servers)
    finally:
        if pauser is not None:
            pauser.stop()
    warm_extra = before.minus(idle).attempts / len(warm) - 1 if warm else 0.0
    share = pauser.stopped_share(started, ended) if pauser is not None else 0.0
    longest = pauser.longest_s(started, ended) if pauser is not None else 0.0
    pauses = pauser.count(started, ended) if pauser is not None else 0
    counted = after.minus(before)
    return Window(calls, counted, ended - started, lag, share, longest, pauses, warm_extra)


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


def figures(
    windows: Sequence[Window], inputs: Inputs, pauser: Pauser | None, node: str, slow_ms: float
) -> dict[str, Any]:
    """One configuration's figures over its rounds, calls pooled."""
    calls = [c for w in windows for c in w.calls]
    ok = [c for c in calls if c.status == "OK"]
    latencies = [c.latency for c in ok]
    wrong = sum(
        not equal(c.reply, inputs.want[c.k % len(inputs.want)]) for c in ok if c.reply is not None
    )
    attempts = sum(w.counted.attempts for w in windows)
    received = sum(w.counted.received for w in windows)
    pauses = sum(w.pauses for w in windows)
    # Calls due during one pause (the pause's share of the window over the pauses in it).
    pause_share = (
        sum(w.stopped_share * w.seconds for w in windows) / sum(w.seconds for w in windows)
        if windows
        else 0.0
    )
    rounds = [pct([c.latency for c in w.calls if c.status == "OK"], 99.9) for w in windows]
    hedges: Counter[str] = Counter()
    for w in windows:
        hedges.update(w.counted.hedges)
    slow = [c for c in ok if c.latency * 1000 > slow_ms]
    return {
        "p50_ms": pct(latencies, 50),
        "p99_ms": pct(latencies, 99),
        "p999_ms": pct(latencies, 99.9),
        "max_ms": max(latencies) * 1000 if latencies else None,
        "p999_ms_rounds": rounds,
        "p999_ms_median": float(np.median([r for r in rounds if r is not None]))
        if any(r is not None for r in rounds)
        else None,
        "calls": len(calls),
        "errors": len(calls) - len(ok),
        "statuses": dict(Counter(c.status for c in calls if c.status != "OK")),
        "answers_checked": len(ok),
        "answers_wrong": wrong,
        "upstream_attempts": attempts,
        "extra_upstream": attempts / len(calls) - 1 if calls else None,
        "balancer_received": received,
        "extra_upstream_of_received": attempts / received - 1 if received else None,
        "hedge_share_of_received": hedges["hedges"] / received
        if received and "hedges" in hedges
        else None,
        # A call that meets a pause on its backend wants a hedge: how many did, a pause.
        "hedges_per_pause": hedges["hedges"] / pauses if pauses and "hedges" in hedges else None,
        "calls_per_pause": len(calls) / pauses * pause_share if pauses else None,
        "hedge_after_ms": [round(w.counted.after_ms, 2) for w in windows],
        "hedges": dict(hedges),
        "cpu_us_per_call": sum(w.counted.cpu_s for w in windows) / len(calls) * 1e6
        if calls
        else None,
        "calls_per_s": len(calls) / sum(w.seconds for w in windows) if windows else 0.0,
        "send_lag_p99_ms": max(w.send_lag_s for w in windows) * 1000 if windows else 0.0,
        "stopped_share": [round(w.stopped_share, 3) for w in windows],
        "warmup_extra_upstream": [round(w.warmup_extra, 4) for w in windows],
        "longest_pause_ms": max(w.longest_pause_s for w in windows) * 1000 if windows else 0.0,
        "slow": {
            "over_ms": slow_ms,
            "calls": len(slow),
            "begun_while_paused": sum(pauser is not None and pauser.paused_at(c.due) for c in slow),
            "answered_by_paused": sum(c.node == node for c in slow),
            "answered_by_paused_all": sum(c.node == node for c in ok),
        },
    }


def has_hedging() -> bool:
    """Whether this checkout's balancer takes --hedge-after-ms."""
    helped = subprocess.run(
        [str(BIN / "sluice-balancer"), "--help"], capture_output=True, text=True, timeout=60
    )
    return "--hedge-after-ms" in helped.stdout


def start_balancer(
    stack: ExitStack, workdir: Path, name: str, backends: Sequence[str], *extra: str
) -> Process:
    listing = workdir / f"{name}.backends"
    write_listing(listing, backends)
    argv = [
        str(BIN / "sluice-balancer"),
        *("--port", "0", "--node-id", name, "--workers", "1"),
        *("--backends-file", str(listing), "--refresh-s", "0.1"),
        *extra,
    ]
    return stack.enter_context(running(argv))


async def settled(balancer: Process, count: int, timeout: float = 20.0) -> None:
    """Until the balancer knows `count` backends, all SERVING."""
    async with AsyncSluiceClient(balancer.address, timeout=5.0) as client:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            health = await client.health()
            states = [b.health for b in health.backends]
            if len(states) == count and set(states) == {"SERVING"}:
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{balancer.address}: backends not all SERVING within {timeout:.0f} s")


def goals(result: Mapping[str, Any]) -> dict[str, bool | None]:
    """The hedging goals, None where a configuration did not run. p99.9 is taken both over
    all rounds' calls pooled and as the median of the rounds' own (a round that a neighbour
    on the shared machine stalled moves the pooled tail, not the median)."""
    figs = result["figures"]
    healthy = figs["healthy"]
    found: dict[str, bool | None] = {}
    for name in ("hedge-5ms", "hedge-auto"):
        f = figs.get(name)
        for key, how in (("p999_ms", "pooled"), ("p999_ms_median", "median of rounds")):
            found[f"{name}: p99.9 ({how}) <= 3x healthy"] = (
                None if f is None else f[key] <= 3 * healthy[key]
            )
        found[f"{name}: extra upstream <= 10%"] = (
            None if f is None else f["extra_upstream_of_received"] <= 0.10
        )
    # At overload many calls end before the balancer takes them in (the client's own lag,
    # their deadline), so hedges count against the calls it took in.
    over = figs.get("overload-hedge-5ms")
    share = None if over is None else over["hedge_share_of_received"]
    found["overload: hedges <= 10% of the calls taken in"] = (
        None if share is None else share <= 0.10
    )
    steady = [figs[n] for n in STEADY if n in figs]
    found["steady: 0 errors, answers equal"] = all(
        f["errors"] == 0 and f["answers_wrong"] == 0 for f in steady
    )
    return found


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(result: Mapping[str, Any]) -> str:
    figs = result["figures"]
    headers = [
        "configuration", "p50 ms", "p99 ms", "p99.9 ms", "p99.9 med", "max ms", "calls", "errors",
        "taken in", "extra upstream", "hedges sent/won/cancelled/refused", "answers equal",
        "CPU us/call", "slow: in pause/by paused",
    ]  # fmt: skip
    rows = []
    for name, label in LABELS.items():
        f = figs.get(name)
        if f is None:
            rows.append([label, *(["not run"] + ["-"] * (len(headers) - 2))])
            continue
        hedges = "/".join(str(v) for v in f["hedges"].values()) or "-"
        slow = f["slow"]
        rows.append([
            label, fmt(f["p50_ms"]), fmt(f["p99_ms"]), fmt(f["p999_ms"]),
            fmt(f["p999_ms_median"]), fmt(f["max_ms"]),
            str(f["calls"]), str(f["errors"]), str(f["balancer_received"]),
            "-" if (x := f["extra_upstream_of_received"]) is None else f"{x:+.1%}",
            hedges, f"{f['answers_checked'] - f['answers_wrong']}/{f['answers_checked']}",
            fmt(f["cpu_us_per_call"], 0),
            f"{slow['calls']}: {slow['begun_while_paused']}/{slow['answered_by_paused']}",
        ])  # fmt: skip
    lines = [
        f"steady {result['rate']:.0f} calls/s ({result['load']:.0%} of capacity "
        f"{result['capacity']:.0f}/s) from {result['callers']} callers, overload "
        f"{result['overload_rate']:.0f}/s; pause {result['pause_ms']:.0f} ms of every "
        f"{result['period_ms']:.0f}; {result['rounds']} rounds x {result['seconds']:g} s; "
        f"load average {result['context']['loadavg_before'][0]:.1f} before, per round "
        + " ".join(f"{r[0]:.1f}" for r in result["context"]["loadavg_rounds"]),
        table(headers, rows),
    ]
    paused = [f"{n} {figs[n]['longest_pause_ms']:.0f}" for n in LABELS if n in figs and n in PAUSED]
    lines.append("longest pause ms (a late SIGCONT stretches one): " + ", ".join(paused))
    for n in HEDGE:
        if (f := figs.get(n)) is not None and f["hedges_per_pause"] is not None:
            lines.append(
                f"{n}: {f['hedges_per_pause']:.1f} hedges a pause, {f['calls_per_pause']:.1f} "
                f"calls due in one; hedge delay at window ends {f['hedge_after_ms']} ms"
            )
    if not result["hedging"]:
        lines.append("this balancer has no --hedge-after-ms: the hedged configurations did not run")
    lines += [
        f"goal {k}: {'-' if v is None else 'met' if v else 'MISSED'}"
        for k, v in result["goals"].items()
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    seconds, warmup = duration(args.duration), duration(args.warmup)
    ctx = paired.context(args.note)
    inputs = make_inputs(args.inputs, args.seed)
    hedging = has_hedging()
    steady = [n for n in STEADY if hedging or n not in HEDGE]
    overload = [n for n in OVERLOAD if hedging or n not in HEDGE] if args.overload else []
    windows: dict[str, list[Window]] = {n: [] for n in [*steady, *overload]}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(TemporaryDirectory(prefix="sluice-hedge-")))
        started = [
            stack.enter_context(
                running(
                    server_argv(
                        *("--device", "cpu", "--workers", "1", "--cache-entries", "0"),
                        node_id=f"hedge-s{i}",
                    )
                )
            )
            for i in range(SERVERS)
        ]
        backends = [s.address for s in started]
        plain = start_balancer(stack, workdir, "plain", backends)
        balancers = {n: plain for n in windows if n not in HEDGE}
        for flag in sorted({HEDGE[n] for n in windows if n in HEDGE}):
            hedged = start_balancer(
                stack,
                workdir,
                f"hedge-{flag}",
                backends,
                *("--hedge-after-ms", flag, *shlex.split(args.hedge_flags)),
            )
            balancers.update({n: hedged for n in windows if HEDGE.get(n) == flag})
        victim = started[0]
        node = "hedge-s0"
        # Registered last, so it runs first: the victim resumes before anything is killed.
        pauser = Pauser(
            [victim.pid, *children(victim.pid)], args.pause_ms / 1e3, args.period_ms / 1e3
        )
        stack.callback(pauser.stop)
        with asyncio.Runner(loop_factory=event_loop) as runner:
            for b in set(balancers.values()):
                runner.run(settled(b, SERVERS))
            cap = args.capacity or runner.run(capacity(plain.address, inputs.bodies, CAPACITY_S))
            rate = args.rate or cap * args.load
            over_rate = cap * args.overload_factor
            first = 0
            for r in range(args.rounds):
                order = steady[r % len(steady) :] + steady[: r % len(steady)]
                for name in [*order, *overload]:
                    is_over = name in OVERLOAD
                    measured = window(
                        balancers[name],
                        started,
                        inputs.bodies,
                        pauser if name in PAUSED else None,
                        rate=over_rate if is_over else rate,
                        callers=args.callers,
                        seconds=seconds,
                        timeout=args.overload_timeout if is_over else args.timeout,
                        warmup=warmup,
                        first=first,
                    )
                    windows[name].append(runner.run(measured))
                    first += len(windows[name][-1].calls)
                    print(f"hedge round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
                ctx["loadavg_rounds"].append(list(os.getloadavg()))
        ctx["loadavg_after"] = list(os.getloadavg())
    result: dict[str, Any] = {
        "command": "python -m perf.hedge " + shlex.join(argv),
        "context": ctx,
        "hedging": hedging,
        "inputs": f"{args.inputs} varied digit images cycled; servers' cache off",
        "rounds": args.rounds,
        "seconds": seconds,
        "warmup_s": warmup,
        "callers": args.callers,
        "capacity": cap,
        "load": rate / cap if cap else 0.0,
        "rate": rate,
        "overload_rate": over_rate,
        "timeout_s": args.timeout,
        "overload_timeout_s": args.overload_timeout,
        "pause_ms": args.pause_ms,
        "hedge_flags": args.hedge_flags,
        "period_ms": args.period_ms,
        "labels": LABELS,
        "figures": {
            n: figures(ws, inputs, pauser if n in PAUSED else None, node, args.slow_ms)
            for n, ws in windows.items()
        },
    }
    result["goals"] = goals(result)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf.hedge",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", default="5s", help="measured time per configuration per round")
    p.add_argument(
        "--warmup", default="2s", help="uncounted calls before each window (paused ones paused)"
    )
    p.add_argument("--callers", type=int, default=4, help="open-loop callers, each its own channel")
    p.add_argument("--load", type=float, default=0.3, help="steady load, share of the capacity")
    p.add_argument("--rate", type=float, default=0.0, help="steady calls/s (instead of --load)")
    p.add_argument(
        "--capacity", type=float, default=0.0, help="calls/s taken as capacity (default: measured)"
    )
    p.add_argument(
        "--hedge-flags",
        default="",
        help="more flags for the hedging balancers (e.g. '--hedge-ratio 0.2'), to see what moves",
    )
    p.add_argument("--pause-ms", type=float, default=100.0, help="the pause, in each period")
    p.add_argument("--period-ms", type=float, default=300.0, help="the pause schedule's period")
    p.add_argument("--timeout", type=float, default=1.0, help="steady calls' deadline, seconds")
    p.add_argument("--overload", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--overload-factor", type=float, default=2.0, help="x capacity")
    p.add_argument("--overload-timeout", type=float, default=0.1, help="deadline, seconds")
    p.add_argument("--inputs", type=int, default=256, help="distinct inputs cycled through")
    p.add_argument("--slow-ms", type=float, default=20.0, help="a call slower is broken down")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="context for the report (the machine's load)")
    p.add_argument("--out", default="", help="write the figures as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(given)
    if args.rounds < 1 or args.callers < 1 or args.inputs < 1:
        raise SystemExit("--rounds, --callers and --inputs must be at least 1")
    if not 0 < args.pause_ms < args.period_ms:
        raise SystemExit("--pause-ms must be above 0 and below --period-ms")
    result = run(args, given)
    paired.save(result, args.out)
    print(render(result))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0 if result["goals"]["steady: 0 errors, answers equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
