"""The pausing-replica scenario (perf.hedge), run for a moment: its table and figures come out,
the steady configurations without a failed call or a wrong answer. No timings are checked."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perf.hedge import HEDGE, LABELS, OVERLOAD, STEADY, Pauser

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_pauser_always_leaves_its_process_running() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        pauser = Pauser([sleeper.pid], pause_s=30.0, period_s=60.0)
        pauser.start()
        deadline = time.monotonic() + 10
        while state(sleeper.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state(sleeper.pid) == "T"  # stopped, mid-pause
        pauser.stop()  # long before the pause would end
        assert state(sleeper.pid) != "T"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_scenario_prints_its_table_with_no_failed_steady_call(tmp_path: Path) -> None:
    out = tmp_path / "hedge.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "perf.hedge", "--rounds", "1", "--duration", "0.5s",
            "--capacity", "300", "--inputs", "32", "--warmup", "0.3s", "--out", str(out),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for label in LABELS.values():
        assert label in done.stdout
    result = json.loads(out.read_text())
    figures = result["figures"]
    ran = [n for n in (*STEADY, *OVERLOAD) if result["hedging"] or n not in HEDGE]
    assert sorted(figures) == sorted(ran)
    for name in STEADY:
        if name in figures:
            f = figures[name]
            assert f["calls"] > 0 and f["errors"] == 0, (name, f["statuses"])
            assert f["answers_checked"] == f["calls"] and f["answers_wrong"] == 0, name
            assert f["upstream_attempts"] >= f["calls"], name
    assert figures["paused"]["stopped_share"][0] > 0  # the victim was paused in its window
    assert figures["healthy"]["stopped_share"] == [0.0]
    if result["hedging"]:  # the balancer's hedge counters read from its Health
        assert set(figures["hedge-5ms"]["hedges"]) >= {"hedges", "hedges_won"}
