"""The fault suite (`python -m perf.faults`) at small scale: a server killed under load
behind the balancer, hostile calls mixed into valid ones, a burst of calls at once. The
bounds allow for a loaded two-core machine: what must hold anywhere is that no caller sees
INTERNAL or CANCELLED, that no valid call is refused as invalid, that every process the
suite started is gone, and that the tables are printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCENARIOS = ["kill9", "bad-flood", "burst"]


# What the suite's command lines hold: its scratch folders, its servers' node ids.
MARKERS = [b"sluice-faults-", b"\0kill9-s", b"\0flood-s", b"\0burst-s"]


def strays() -> set[int]:
    """Live processes whose command line holds one of MARKERS (Linux: from /proc)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if any(marker in cmdline.read_bytes() for marker in MARKERS):
                found.add(int(cmdline.parent.name))
        except OSError:
            continue  # it exited while we looked
    return found


def test_the_quick_fault_suite_runs_and_no_caller_sees_internal(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    argv = [sys.executable, "-m", "perf.faults", "--quick", "--out", str(out)]
    for name in SCENARIOS:
        argv += ["--scenario", name]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in SCENARIOS:
        assert f"== {name}:" in done.stdout, done.stdout
    assert "== summary" in done.stdout

    result = json.loads(out.read_text())
    by_name = {s["name"]: s for s in result["scenarios"]}
    assert sorted(by_name) == sorted(SCENARIOS)
    for scenario in result["scenarios"]:
        assert scenario["error"] == "", scenario["error"]
        for row in scenario["rows"]:
            # Deadlines may expire on a busy machine; a defect's statuses may not.
            for status in ("INTERNAL", "UNKNOWN", "CANCELLED", "CLIENT_ERROR"):
                assert status not in row["failures"], (scenario["name"], row)

    kill9 = by_name["kill9"]
    assert kill9["facts"]["detection s (balancer Health: out)"] is not None
    rows = {r["name"]: r for r in kill9["rows"]}
    for phase in ("before", "after restart"):  # calls flowed before the fault and after it
        assert rows[phase]["ok"] > 0, kill9["rows"]

    flood = by_name["bad-flood"]
    valid, *hostile = flood["rows"]
    assert "INVALID_ARGUMENT" not in valid["failures"], valid
    for row in hostile:
        assert row["ok"] == 0 and row["failures"].get("INVALID_ARGUMENT", 0) > 0, row
    assert flood["goals"]["no INTERNAL anywhere"]
    assert flood["goals"]["no breaker opened, no failure counted"]

    for row in by_name["burst"]["rows"]:
        assert row["calls"] == 600, row  # every call of the burst got an answer

    # Nothing the suite started outlives it.
    assert not strays(), "a process of the fault suite is still running"
