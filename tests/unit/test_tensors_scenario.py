"""The large-tensor benchmark scenario's figures (perf/tensors_figures.py, for perf/tensors.py):
its plan, the engines it can run, ONNX Runtime alone on a small averaging model, and the
arithmetic from sweep figures to the goals' ratios and the table. No timing is judged: the
figures below are made up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perf import make_pool, tensors_figures

PROCESSES = {"echo", "off", "floor", "arena", "hits", "balancer", "proxy"}


def test_the_plan_sweeps_every_row_against_a_started_process() -> None:
    plan = tensors_figures.cells("/tmp/image.npy", "1,32")
    assert {cell.target for cell in plan.values()} <= PROCESSES
    for name in ("echo-602k", "pool", "squeezenet", "balancer-602k", "proxy-602k"):
        assert plan[name].args[-2:] == ("--data", "/tmp/image.npy")
    # the served squeezenet, its floor and the arena server get the same call, at c=1
    for name in ("squeezenet-floor", "squeezenet-arena"):
        assert plan[name].args == plan["squeezenet"].args and plan[name].levels == "1"
    assert {plan[n].target for n in ("squeezenet", "squeezenet-floor", "squeezenet-arena")} == {
        "off",
        "floor",
        "arena",
    }
    assert plan["balancer-digits"].levels == plan["proxy-602k"].levels == "1,32"
    assert "1" in plan["digits-off"].levels.split(",")  # the digits hop's direct path
    # the hop compares paths to the same model on the same server
    assert plan["balancer-602k"].args == plan["proxy-602k"].args == plan["pool"].args
    labelled = {name for _, name, _, _ in tensors_figures.ROWS}
    assert labelled == set(plan)


def test_the_engines_that_can_run_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no h2load here
    assert tensors_figures.engines_of("python,h2load") == ["python"]
    with pytest.raises(SystemExit, match="h2load on PATH"):
        tensors_figures.engines_of("h2load")
    with pytest.raises(SystemExit, match="--engines"):
        tensors_figures.engines_of("python,ghz")


def test_ort_alone_times_and_costs_each_run(tmp_path: Path) -> None:
    model = tmp_path / "pool8.onnx"
    model.write_bytes(make_pool.build(8))
    array = np.ones((1, 3, 8, 8), np.float32)
    for spinning in (False, True):
        wall, cpu = time.perf_counter(), time.process_time()
        figures = tensors_figures.ort_alone(model, array, 1, spinning, seconds=0.05)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        # Measured here, around the call: half the runs took at least the p50, and the runs'
        # CPU is within this process's (units or counts gone wrong break one of these).
        assert 0 < figures["runs"] * figures["p50"] / 2 <= wall * 1e3
        assert figures["runs"] * figures["cpu_ms"] <= cpu * 1e3 + 1e-6
    configs = tensors_figures.ort_configs(Path("pool"), Path("squeeze"))
    assert configs["pool"] == (Path("pool"), 1, False)
    assert configs["squeezenet-2t-spin-on"] == (Path("squeeze"), 2, True)
    assert len(configs) == 1 + 2 * len(tensors_figures.ORT_THREADS)


def run(p50s: list[float], cpus: list[float | None]) -> dict[str, Any]:
    """A sweep's result as paired.sweep_once returns it, one level per figure."""
    levels = [
        {
            "latency": {"p50": p50, "p99": 2 * p50},
            "throughput": 100.0,
            "calls": 10,
            "ok": 10,
            "client_saturated": False,
            "target_cpu": {} if cpu is None else {"per_call_ms": cpu},
        }
        for p50, cpu in zip(p50s, cpus, strict=True)
    ]
    return {"levels": levels, "warnings": []}


# (c=1 or only level p50, CPU per call) of each configuration, the same every round
FIGURES = {
    "echo-602k": (1.0, 0.5),
    "pool": (1.2, 0.9),  # 1.2x the echo: PASS
    "squeezenet": (4.0, 4.0),  # p50 4.0 / (2.0 + 1.0), CPU 4.0 / (2.5 + 0.5): 1.33x, MISS
    "squeezenet-floor": (3.3, 3.3),  # 1.1x both: PASS; the served one over it 1.21x both
    "squeezenet-arena": (3.6, 3.0),  # p50 1.2x: MISS, CPU 1.0x: PASS; over the floor: PASS
    "echo-digits": (5.0, 0.2),
    "digits-off": (0.5, 0.28),  # c=32's CPU 0.28 / 0.2 = 1.4x: PASS
    "digits-hits": (3.0, 0.25),  # 1.25x: MISS
    "balancer-digits": (0.65, 0.4),  # +0.15 ms: PASS; CPU 0.4 / 0.5 = 0.8x: PASS
    "proxy-digits": (0.9, 0.5),
    "balancer-602k": (1.6, None),  # +0.4 ms: MISS; no CPU figure: n/a
    "proxy-602k": (2.0, 1.0),
}


def made_up_sweeps() -> dict[str, Any]:
    plan = tensors_figures.cells("image.npy", "1")
    runs = {}
    for name, cell in plan.items():
        p50, cpu = FIGURES[name]
        width = len(cell.levels.split(","))
        rounds = [run([p50] * width, [cpu] * width) for _ in range(3)]
        rounds[1]["levels"][0]["target_cpu"] = {}  # a round without the target's CPU
        runs[name] = rounds
    return tensors_figures.summarize(runs, plan)


ORT = {
    "pool": {"p50": 0.05, "cpu_ms": 0.05},
    "squeezenet-1t-spin-off": {"p50": 3.0, "cpu_ms": 2.9},
    "squeezenet-2t-spin-off": {"p50": 2.0, "cpu_ms": 2.5},
    "squeezenet-1t-spin-on": {"p50": 2.9, "cpu_ms": 2.9},
    "squeezenet-2t-spin-on": {"p50": 1.5, "cpu_ms": 3.0},
}


def test_medians_over_rounds_skip_a_round_without_the_targets_cpu() -> None:
    runs = [run([1.0], [0.3]), run([2.0], [None]), run([3.0], [0.5])]
    assert tensors_figures.median_cpu(runs, 0) == pytest.approx(0.4)
    assert tensors_figures.median_cpu([run([1.0], [None])], 0) is None
    sweeps = made_up_sweeps()
    assert sweeps["digits-off"]["c32"]["cpu_ms"] == pytest.approx(0.28)
    assert sweeps["digits-off"]["c1"]["p50"] == pytest.approx(0.5)
    assert [r["cpu_ms"] for r in sweeps["pool"]["c1"]["rounds"]] == [0.9, None, 0.9]
    assert sweeps["pool"]["errors"] == 0 and not sweeps["pool"]["saturated"]


def test_the_goals_are_ratios_against_the_floors() -> None:
    assert tensors_figures.best(ORT, "off") == "squeezenet-2t-spin-off"
    assert tensors_figures.best(ORT, None) == "squeezenet-2t-spin-on"
    found = {g["goal"]: g for g in tensors_figures.goals(made_up_sweeps(), ORT, "c1")}
    expected = {
        "averaging model, c=1 p50 / the echo floor's (602 KB)": (1.2, "PASS"),
        "squeezenet, c=1 p50 / (ONNX Runtime alone, best threads + echo)": (4 / 3, "MISS"),
        "squeezenet, CPU per call / (ONNX Runtime alone's + echo's)": (4 / 3.0, "MISS"),
        "squeezenet floor (bare grpc.aio + ORT inline), c=1 p50 / "
        "(ONNX Runtime alone, best threads + echo)": (1.1, "PASS"),
        "squeezenet floor (bare grpc.aio + ORT inline), CPU per call / "
        "(ONNX Runtime alone's + echo's)": (1.1, "PASS"),
        "squeezenet --ort-arena on, c=1 p50 / (ONNX Runtime alone, best threads + echo)": (
            1.2,
            "MISS",
        ),
        "squeezenet --ort-arena on, CPU per call / (ONNX Runtime alone's + echo's)": (
            1.0,
            "PASS",
        ),
        "squeezenet, c=1 p50 / the floor's": (4 / 3.3, "MISS"),
        "squeezenet, CPU per call / the floor's": (4 / 3.3, "PASS"),
        "squeezenet --ort-arena on, c=1 p50 / the floor's": (3.6 / 3.3, "PASS"),
        "squeezenet --ort-arena on, CPU per call / the floor's": (3.0 / 3.3, "PASS"),
        "digits at 32 in flight, cache off: CPU per call / the echo floor's": (1.4, "PASS"),
        "digits at 32 in flight, hits: CPU per call / the echo floor's": (1.25, "MISS"),
        "balancer hop, digits: added c=1 p50 (ms)": (0.15, "PASS"),
        "balancer hop, 602k: added c=1 p50 (ms)": (0.4, "MISS"),
        "balancer hop, digits: CPU per forwarded call (c1) / the bare proxy's": (0.8, "PASS"),
        "balancer hop, 602k: CPU per forwarded call (c1) / the bare proxy's": (None, "n/a"),
    }
    assert set(found) == set(expected)
    for name, (measured, verdict) in expected.items():
        if measured is None:
            assert found[name]["measured"] is None
        else:
            assert found[name]["measured"] == pytest.approx(measured), name
        assert found[name]["result"] == verdict, name
    squeeze = found["squeezenet, CPU per call / (ONNX Runtime alone's + echo's)"]
    assert squeeze["floor"] == "squeezenet-2t-spin-off 2.500 + echo 0.500 ms"
    assert found["balancer hop, digits: added c=1 p50 (ms)"]["floor"] == "bare proxy +0.400 ms"
    assert found["squeezenet --ort-arena on, CPU per call / the floor's"]["floor"] == (
        "floor 3.300 ms"
    )


def test_the_table_has_every_row_and_every_goal_for_each_engine() -> None:
    sweeps = made_up_sweeps()
    result = {
        "command": "python -m perf.tensors",
        "context": {
            "commit": "abc",
            "started": "now",
            "cpus": 2,
            "loadavg_before": [1.0, 1.0, 1.0],
            "loadavg_after": [2.0, 1.0, 1.0],
            "note": "Others were running tests.",
        },
        "rounds": 3,
        "engines": ["python", "h2load"],
        "ort_alone": ORT,
        "ort_best_any": tensors_figures.best(ORT, None),
        "squeezenet_threads": 2,
        "hop_level": "c1",
        "sweeps": {"python": sweeps, "h2load": sweeps},
        "goals": {e: tensors_figures.goals(sweeps, ORT, "c1") for e in ("python", "h2load")},
    }
    text = tensors_figures.markdown(result)
    for label, _, _, _ in tensors_figures.ROWS:
        assert f"| {label}" in text
    for threads in ("1t", "2t"):
        for spinning in ("on", "off"):
            assert f"| squeezenet, ONNX Runtime alone, {threads}-spin-{spinning} |" in text
    assert "Others were running tests." in text
    assert text.count("**PASS**") == 2 * 10 and text.count("**MISS**") == 2 * 6
    assert text.count("**n/a**") == 2
    assert "| 1.200 | 0.900 | 1.200 | 0.900 |" in text  # the averaging model, both engines
    # the floor and the arena server: their figures, on the served squeezenet's threads
    threads = "(intra-op threads: 2, spinning off)"
    assert f"perf/echo_server.py --model {threads} | c=1 | floor | 3.300 | 3.300 |" in text
    assert f"--ort-arena on {threads} | c=1 | server | 3.600 | 3.000 |" in text


def test_the_served_threads_are_read_from_the_servers_log() -> None:
    log = (
        "INFO sluice.engine squeezenet11x0.5_224.onnx: a batch of one takes 3.10 ms on 1 "
        "thread, 2.00 ms on 2: 2 intra-op threads\n"
    )
    assert tensors_figures.served_threads(log, Path("/c/squeezenet11x0.5_224.onnx")) == 2
    assert tensors_figures.served_threads(log, Path("/c/pool224.onnx")) == 1  # no line: 1 thread
