"""Hedging on real processes: three servers behind a balancer started with --hedge-after-ms,
one of them stopped (SIGSTOP). Its keepalive is set long, so only hedging can answer the
calls it owns before their deadline: they are answered by another server, well within it.
A call whose deadline is shorter than the hedge delay is not hedged: it runs out of time on
the stopped server, and the same call with time enough is hedged and answered."""

from __future__ import annotations

import asyncio
import signal
import time
from contextlib import ExitStack

import grpc
import pytest

from sluice.client import AsyncSluiceClient
from tests.e2e.harness import Cluster, start_cluster
from tests.e2e.test_balancer_e2e import digit

pytestmark = pytest.mark.e2e

DELAY_MS = 300
DEADLINE_S = 5.0  # each call's: a call left on the stopped server would run it out
FLAGS = (
    *("--hedge-after-ms", str(DELAY_MS)),
    # Every call may hedge (a third of them need to), and the stopped server is not found
    # out by keepalive pings within the test (60 s): only hedges can answer its calls.
    *("--hedge-ratio", "1"),
    *("--keepalive-s", "60"),
)


def stopped_calls(cluster: Cluster, address: str) -> int:
    return cluster.backend(address).calls


async def test_a_stopped_servers_calls_are_answered_by_hedges_within_their_deadline() -> None:
    with ExitStack() as stack:
        cluster = start_cluster(stack, 3, *FLAGS)
        hung = cluster.servers[0]
        async with AsyncSluiceClient(cluster.balancer.address, timeout=DEADLINE_S) as client:
            for seed in range(6):  # every server answers before the stop
                await client.predict({"input": digit(seed)})
            before = stopped_calls(cluster, hung.address)
            hung.proc.send_signal(signal.SIGSTOP)
            try:
                seconds: list[float] = []

                async def worker(first: int) -> None:
                    for seed in range(first, first + 30, 3):  # unique inputs: all owners
                        started = time.monotonic()
                        answer = await client.infer({"input": digit(seed)})
                        seconds.append(time.monotonic() - started)
                        assert answer.node_id != "server-0"

                await asyncio.gather(*(worker(100 + i) for i in range(3)))
                owned = stopped_calls(cluster, hung.address) - before
            finally:
                hung.proc.send_signal(signal.SIGCONT)  # never leave a stopped process behind
        stats = cluster.health().balancer
    assert len(seconds) == 30
    assert stats.hedges >= 1 and stats.hedges_won >= 1, stats
    assert stats.hedges_won <= stats.hedges <= 30
    assert owned >= 1  # calls went to the stopped server, and were answered all the same
    # Loose (a loaded 2-core machine): each call beats its deadline by far, which a call
    # left on the stopped server could not.
    assert max(seconds) < DEADLINE_S / 2, sorted(seconds)[-3:]


async def test_a_call_with_less_time_left_than_the_delay_is_not_hedged() -> None:
    with ExitStack() as stack:
        cluster = start_cluster(stack, 3, *FLAGS)
        hung = cluster.servers[0]
        async with AsyncSluiceClient(cluster.balancer.address, timeout=DEADLINE_S) as client:
            for seed in range(6):
                await client.predict({"input": digit(seed)})
            hung.proc.send_signal(signal.SIGSTOP)
            try:
                short = DELAY_MS / 1000 / 2
                for seed in range(200, 260):  # an input the stopped server owns
                    before = stopped_calls(cluster, hung.address)
                    try:
                        await client.predict({"input": digit(seed)}, timeout=short)
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                    if stopped_calls(cluster, hung.address) > before:
                        break
                else:
                    pytest.fail("no input went to the stopped server")
                assert cluster.health().balancer.hedges == 0
                # The same input with time enough: hedged, and answered elsewhere.
                answer = await client.infer({"input": digit(seed)})
                assert answer.node_id != "server-0"
            finally:
                hung.proc.send_signal(signal.SIGCONT)
        assert cluster.health().balancer.hedges == 1
