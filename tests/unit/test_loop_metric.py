"""sluice_loop_cpu_seconds: the CPU time of the thread that runs the event loop, whose rate
the autoscalers read as the loop's busy share (deploy/autoscaling)."""

from __future__ import annotations

import threading
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sluice.runtime import metrics


def samples(collector: metrics.LoopCollector) -> dict[str, float]:
    return {s.name: s.value for family in collector.collect() for s in family.samples}


def test_the_counter_is_the_loop_threads_cpu_clock() -> None:
    now = [1.5]
    collector = metrics.LoopCollector(cpu_clock=lambda: now[0])
    assert samples(collector) == {"sluice_loop_cpu_seconds_total": 1.5}
    now[0] = 2.25
    assert samples(collector) == {"sluice_loop_cpu_seconds_total": 2.25}


def test_the_clock_counts_the_thread_that_made_it_wherever_it_is_read() -> None:
    """Made on one thread that then burns CPU, read from another: the maker's time, not the
    reader's (a scrape may be served off the loop's thread)."""
    made: list[metrics.LoopCollector] = []
    spent = [0.0]
    ready, release = threading.Event(), threading.Event()

    def loop_thread() -> None:
        made.append(metrics.LoopCollector())
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            pass
        spent[0] = time.thread_time()
        ready.set()
        release.wait(30)

    thread = threading.Thread(target=loop_thread)
    thread.start()
    try:
        assert ready.wait(30)
        (collector,) = made
        read_here = samples(collector)["sluice_loop_cpu_seconds_total"]
        assert read_here >= spent[0] >= 0.05
    finally:
        release.set()
        thread.join(30)


def test_every_registry_has_it() -> None:
    text = generate_latest(metrics.new_registry()).decode()
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert "sluice_loop_cpu_seconds_total" in names
