"""A hung server (SIGSTOP): the balancer's keepalive pings find it within seconds, its
calls go to the others, and it comes back when it resumes."""

from __future__ import annotations

import asyncio
import signal
import time
from contextlib import ExitStack

import pytest

from tests.e2e.test_balancer_e2e import Load, start_cluster, until

pytestmark = pytest.mark.e2e


async def test_a_stopped_server_is_taken_out_by_keepalive_and_no_call_fails() -> None:
    with ExitStack() as stack:
        cluster = start_cluster(stack, 3, "--keepalive-s", "0.5")
        hung = cluster.servers[0]
        load = Load(cluster.balancer.address)
        running_load = asyncio.create_task(load.run())
        try:
            await until(lambda: load.ok > 200, "load to flow")
            hung.proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            # Its health watch cannot hear NOT_SERVING from a stopped process: only the
            # unanswered pings can take it out (bounded wait: a hang guard, not a timing).
            await until(
                lambda: cluster.backend(hung.address).health == "NOT_SERVING",
                "the stopped server to be taken out",
            )
            detected_s = time.monotonic() - stopped
            served = load.ok
            await until(lambda: load.ok > served + 300, "traffic on the others")
            calls_while_out = cluster.backend(hung.address).calls
            served = load.ok
            await until(lambda: load.ok > served + 200, "more traffic on the others")
            assert cluster.backend(hung.address).calls == calls_while_out  # it got none
            hung.proc.send_signal(signal.SIGCONT)
            await until(
                lambda: cluster.backend(hung.address).health == "SERVING",
                "the resumed server to come back",
            )
        finally:
            hung.proc.send_signal(signal.SIGCONT)  # never leave a stopped process behind
            load.stop.set()
            await running_load
        # Calls in flight on the stopped server's streams broke and were retried elsewhere.
        assert load.failures == [], load.failures[:5]
        print(f"detected after {detected_s:.2f} s")  # context for -s runs; not asserted
