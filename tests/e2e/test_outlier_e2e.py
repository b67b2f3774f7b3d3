"""A slow but alive server (stopped for most of every 200 ms: its calls take up to 150 ms
while the others answer in a few): latency outlier detection ejects it for a while (its
breaker opens; its health stays SERVING, its connection is kept), no call fails, and the
HTTP/2 pings, answered within their timeout, never take it for hung."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from contextlib import ExitStack

import pytest

from tests.e2e.harness import start_cluster
from tests.e2e.test_balancer_e2e import Load, until

pytestmark = pytest.mark.e2e


def stutter(pid: int, stop: threading.Event, paused_s: float = 0.15, run_s: float = 0.05) -> None:
    """SIGSTOP / SIGCONT `pid` in turn until `stop` is set; leaves it running."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            stop.wait(paused_s)
            os.kill(pid, signal.SIGCONT)
            stop.wait(run_s)
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_a_slow_server_is_ejected_as_an_outlier_not_taken_for_hung() -> None:
    with ExitStack() as stack:
        cluster = start_cluster(stack, 3)  # default settings
        slow = cluster.servers[0]
        load = Load(cluster.balancer.address)
        running_load = asyncio.create_task(load.run())
        stop = threading.Event()
        stutterer = threading.Thread(target=stutter, args=(slow.pid, stop), daemon=True)
        try:
            await until(lambda: load.ok > 200, "load to flow")
            stutterer.start()
            started = time.monotonic()
            await until(
                lambda: cluster.backend(slow.address).breaker in ("OPEN", "HALF_OPEN"),
                "the slow server to be ejected",
            )
            status = cluster.backend(slow.address)
            assert status.health == "SERVING"  # out by its latency, not as hung
            assert status.failures == 0  # nor by failures: no call of it failed
            ejected = time.monotonic() - started
            served = load.ok
            await until(lambda: load.ok > served + 300, "traffic on the others")
            assert cluster.backend(slow.address).health == "SERVING"
            stop.set()
            stutterer.join(timeout=5)
            # Recovered: it closes again (probes, then judged fine) and takes calls.
            await until(lambda: cluster.backend(slow.address).breaker == "CLOSED", "its return")
            calls = cluster.backend(slow.address).calls
            await until(lambda: cluster.backend(slow.address).calls > calls + 50, "its calls")
        finally:
            stop.set()
            slow.proc.send_signal(signal.SIGCONT)  # never leave a stopped process behind
            load.stop.set()
            await running_load
        assert load.failures == [], load.failures[:5]
        print(f"ejected after {ejected:.2f} s")  # context for -s runs; not asserted
