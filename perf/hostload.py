"""The load of the hosts tier and its fault scenario, run on the lab's client host
(`ip netns exec CLIENT python -m perf.hostload ...`): several callers in a closed loop through
one Sluice client given every --target (two balancers: the client's own planner passes over
one that is down), each call kept with its start, latency, status and the node that answered;
the first target's Health is sampled meanwhile, to time when a backend leaves or joins.

It waits until every target reports --ready backends serving with their breakers closed
(sending unrecorded calls, one at a time, while a breaker is on probation: only answered
calls close one), prints `started T0` (time.monotonic(), one clock for every process of the
machine), loads for --seconds, and writes its records and samples as JSON to --out."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from perf.drive import digits_bodies
from sluice.client import AsyncSluiceClient


def serving(health: Any) -> list[str]:
    return [b.address for b in health.backends if b.health == "SERVING" and b.breaker == "CLOSED"]


def on_probation(health: Any) -> bool:
    """Some backend serves but its breaker is not closed: only calls close it (two probes
    answered), and between loads none come, so it would stay so (a latency ejection near
    the end of the last load, on a loaded machine)."""
    return any(b.health == "SERVING" and b.breaker != "CLOSED" for b in health.backends)


def views(health: Any) -> str:
    return ", ".join(f"{b.address} {b.health} {b.breaker}" for b in health.backends) or "none"


async def wait_ready(
    watcher: AsyncSluiceClient, count: int, timeout_s: float, probe: Callable[[], Awaitable[Any]]
) -> None:
    """Until `count` backends serve with their breakers closed; while a breaker is on
    probation, one call (`probe`, unrecorded) at a time gives it the calls it needs."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            health = await watcher.health(timeout=1.0)
            last = views(health)
            if len(serving(health)) >= count:
                return
            if on_probation(health):
                await probe()
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the balancer did not report {count} backends serving: {last}")
        await asyncio.sleep(0.05)


async def sample(watcher: AsyncSluiceClient, into: list[Any], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            health = await watcher.health(timeout=0.5)
            view = {b.address: [b.health, b.breaker, int(b.calls)] for b in health.backends}
            into.append([time.monotonic(), view])
        except grpc.RpcError:
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


async def load(args: argparse.Namespace) -> dict[str, Any]:
    bodies = digits_bodies()
    records: list[list[Any]] = []
    samples: list[Any] = []
    stop = asyncio.Event()
    async with (
        AsyncSluiceClient(args.target) as client,
        AsyncSluiceClient(args.target[0]) as watcher,
    ):
        issued = 0

        async def probe() -> None:
            nonlocal issued
            issued += 1  # each body unique: no answer from a cache
            await client.call_raw(bodies.body(issued - 1), timeout=args.timeout)

        for target in args.target:
            async with AsyncSluiceClient(target) as each:
                await wait_ready(each, args.ready, args.ready_s, probe)
        sampler = asyncio.create_task(sample(watcher, samples, stop))
        t0 = time.monotonic()
        print(f"started {t0}", flush=True)
        end = t0 + args.seconds

        async def caller() -> None:
            nonlocal issued
            while time.monotonic() < end:
                k = issued
                issued += 1
                start = time.monotonic()
                reply = await client.call_raw(bodies.body(k), timeout=args.timeout)
                status = grpc.StatusCode.OK.name
                if reply.code:
                    status = next(c.name for c in grpc.StatusCode if c.value[0] == reply.code)
                node = reply.trailers.get("x-node-id", "")
                records.append([start, time.monotonic() - start, status, node])

        await asyncio.gather(*(caller() for _ in range(args.callers)))
        stop.set()
        await sampler
    return {"t0": t0, "records": records, "samples": samples}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.hostload", description=__doc__)
    p.add_argument("--target", action="append", required=True, help="HOST:PORT, repeatable")
    p.add_argument("--callers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--timeout", type=float, default=1.0, help="each call's deadline, seconds")
    p.add_argument("--ready", type=int, default=1, help="backends serving before the load")
    p.add_argument("--ready-s", type=float, default=60.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    Path(args.out).write_text(json.dumps(asyncio.run(load(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
