"""failing-model: one of three servers behind the balancer fails every call (INTERNAL)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from perf.bench import Bench
from perf.drive import collect, digits_bodies
from perf.faults.results import Outcome, between, fmt_s, summarize
from perf.faults.watch import Watch


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
