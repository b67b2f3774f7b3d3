"""The metrics deploy/autoscaling scales the servers on, read from a real server's /metrics:
its calls in flight rise with the callers loading it and fall back to the idle value once
they stop. The autoscalers read the rate of the series the adapter rules name (the seconds
of calls finished: its rate is the mean in flight; the loop's CPU seconds); the gauge
beside it shows the same calls at the moment of a scrape."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
import yaml

from sluice.client import AsyncSluiceClient
from tests.e2e.harness import NOT_INLINE, hold_the_instance, rows, running, server_argv, wait_for
from tests.e2e.test_metrics_e2e import Samples, free_port, get, scrape, total

pytestmark = pytest.mark.e2e

ADAPTER_VALUES = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "autoscaling"
    / "hpa"
    / "prometheus-adapter-values.yaml"
)
CALLERS = 6
ROUNDS = 10  # calls each caller makes, one after another
BLOCKER_ROWS = 32_000  # seconds of work for the one instance: the callers queue behind it


def scaled_series(served: str) -> str:
    """The series the adapter rule serving `served` (and the KEDA query, checked against it)
    reads."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    (rule,) = [r for r in rules if r["name"]["as"] == served]
    match = re.fullmatch(r"(\w+)\{[^}]*\}", rule["seriesQuery"])
    assert match, rule["seriesQuery"]
    return match[1]


def calls(samples: Samples, series: str) -> tuple[float, float]:
    """The series' value (seconds of calls finished) and the count of calls beside it."""
    return total(samples, series), total(samples, series.removesuffix("_sum") + "_count")


def gauges(samples: Samples) -> tuple[float, float]:
    return get(samples, "sluice_in_flight"), get(samples, "sluice_queue_depth")


async def test_calls_in_flight_rise_with_load_and_fall_back_when_it_stops(mlp: Path) -> None:
    series = scaled_series("sluice_in_flight_average")
    loop = scaled_series("sluice_loop_busy")
    port = free_port()
    # One instance, one row a run: what the callers send waits, in flight, while a long call
    # holds it, so the rise is there to see however slow this machine is.
    argv = server_argv(
        *("--metrics-port", str(port), "--instances", "1", "--max-batch", "1"),
        *("--cache-entries", "0", *NOT_INLINE),
        model=mlp,
    )
    with running(argv) as server:
        async with AsyncSluiceClient(server.address, timeout=300) as client:
            idle = await asyncio.to_thread(scrape, port)
            assert gauges(idle) == (0, 0)
            holding = await hold_the_instance(
                client, server.address, blocker_rows=BLOCKER_ROWS, seed=40
            )

            async def caller(seed: int) -> None:
                for x in rows(ROUNDS, seed=seed):
                    await client.predict({"input": x.repeat(16, axis=0)})

            def all_in_flight() -> Samples | None:
                samples = scrape(port)
                return samples if gauges(samples) == (CALLERS + 1, CALLERS) else None

            callers = [asyncio.create_task(caller(100 + i)) for i in range(CALLERS)]
            # Every caller's first call waits behind the long one: in flight, all of them.
            loaded = await asyncio.to_thread(
                wait_for, all_in_flight, "every caller's call in flight"
            )
            loaded_at = time.monotonic()
            await holding
            await asyncio.gather(*callers)
            done = await asyncio.to_thread(scrape, port)
            done_at = time.monotonic()
            # Stopped: nothing in flight, and nothing more finishes between two scrapes.
            quiet = await asyncio.to_thread(scrape, port)
            quiet_again = await asyncio.to_thread(scrape, port)

    (seconds_loaded, count_loaded), (seconds_done, count_done) = (
        calls(loaded, series),
        calls(done, series),
    )
    # Every call that was in flight at the loaded scrape, and every later one, finished
    # before the next: the long one and each caller's rounds.
    assert count_done - count_loaded == 1 + CALLERS * ROUNDS
    mean_in_flight = (seconds_done - seconds_loaded) / (done_at - loaded_at)
    # Seven calls in flight at the loaded scrape (seconds of work queued), then six callers
    # each with one out until its last: the rate of the call seconds is several calls.
    assert mean_in_flight > 1, mean_in_flight
    # Between two scrapes at rest the series stands still: its rate, the metric, is 0 again.
    assert calls(quiet_again, series) == calls(quiet, series) == calls(done, series)
    assert gauges(done) == gauges(quiet) == gauges(quiet_again) == gauges(idle) == (0, 0)
    # The loop's CPU: the callers' calls cost it more than a scrape at rest does.
    loaded_cpu = total(done, loop) - total(loaded, loop)
    assert loaded_cpu > total(quiet_again, loop) - total(quiet, loop) >= 0
