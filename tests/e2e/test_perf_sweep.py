"""A short real sweep against a real server and the floors: every output file, sane numbers."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import (
    BIN,
    Process,
    module_argv,
    running,
    server_argv,
    with_workers,
    workers,
)

pytestmark = pytest.mark.e2e


def sweep(*args: str) -> subprocess.CompletedProcess[str]:
    """`sluice perf ARGS` as a user runs it; fails the test if it fails."""
    return subprocess.run(
        [str(BIN / "sluice"), "perf", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_sweep_writes_every_output_with_sane_numbers(server: Process, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = sweep(
        "--target", server.address, "-c", "1,4", "-z", "1s", "--warmup", "0.2s", "--procs", "2",
        "--unique", "--out", str(out),
    )  # fmt: skip
    assert "c=1" in done.stdout and "c=4" in done.stdout  # the live table
    result = json.loads(out.with_suffix(".json").read_text())
    levels = result["levels"]
    assert [lv["value"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["calls"] > 50 and lv["ok"] == lv["calls"], lv["statuses"]
        lat = lv["latency"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p999"] <= lat["max"]
        assert lat["max"] < 10_000
        assert 0 < lv["client_cpu"] < 1.5
        # The server saw (at least) every call the sweep counted: warm-up calls come on top.
        assert lv["server"]["requests"] >= lv["calls"]
        assert lv["server"]["mean_batch"] == 1.0  # the batcher is off on this server
        assert lv["server"]["cache_hit_rate"] == 0.0  # unique inputs: no cache can answer
        assert lv["throughput"] == pytest.approx(lv["calls"] / lv["wall_s"])
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["value"]) for r in rows] == [1.0, 4.0]
    assert "| c=1" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_reports_the_local_targets_cpu_per_call(server: Process, tmp_path: Path) -> None:
    out = tmp_path / "cpu"
    done = sweep(
        "--target", server.address, "-c", "2", "-z", "1s", "--warmup", "0.2s", "--unique",
        "--out", str(out),
    )  # fmt: skip
    assert "target cpu/call" in done.stdout  # the live table
    result = json.loads(out.with_suffix(".json").read_text())
    (level,) = result["levels"]
    cpu = level["target_cpu"]
    # Found by its port: the server alone (no workers, no children).
    assert (
        cpu["pids"] == [server.pid]
        and cpu["found"] == f"listening on port {server.address.rsplit(':', 1)[1]}"
    )
    assert cpu["per_call_ms"] > 0 and cpu["cpu_s"] > 0 and cpu["cores"] > 0
    assert result["warnings"] == []
    table = out.with_suffix(".md").read_text()
    assert "| target cpu/call |" in table and f"{cpu['per_call_ms']:.3f} ms" in table
    with out.with_suffix(".csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["target_cpu_ms_per_call"]) == pytest.approx(cpu["per_call_ms"])
    # Off: not measured, and no column.
    sweep(
        "--target", server.address, "-c", "2", "-n", "20", "--warmup", "0", "--quiet",
        "--target-cpu", "off", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["levels"][0]["target_cpu"] == {} and result["warnings"] == []
    assert "target cpu/call" not in out.with_suffix(".md").read_text()


def test_the_cpu_of_every_worker_on_the_port_is_summed(tmp_path: Path) -> None:
    argv = server_argv("--workers", "2", node_id="perf-w")
    with with_workers(argv, 2, b"sluice.server.main") as server:
        (worker,) = workers(server, 1)
        out = tmp_path / "workers"
        sweep(
            "--target", server.address, "-c", "4", "--connections", "4", "-n", "200",
            "--warmup", "0", "--quiet", "--out", str(out),
        )  # fmt: skip
    cpu = json.loads(out.with_suffix(".json").read_text())["levels"][0]["target_cpu"]
    # Both hold a socket on the port (SO_REUSEPORT): found as listeners, not as a child.
    assert cpu["pids"] == sorted([server.pid, worker]) and cpu["children"] == []
    assert cpu["per_call_ms"] > 0


def test_a_target_pid_that_is_gone_leaves_the_field_empty_with_a_warning(
    server: Process, tmp_path: Path
) -> None:
    out = tmp_path / "gone"
    done = sweep(
        "--target", server.address, "-n", "20", "--warmup", "0", "--target-pid", "999999999",
        "--quiet", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["levels"][0]["target_cpu"] == {}
    assert result["warnings"] == ["target pid gone (--target-pid 999999999): no target cpu/call"]
    assert "WARNING: target pid gone" in done.stderr
    assert "| - |" in out.with_suffix(".md").read_text()


def test_open_loop_sweep_through_the_bare_proxy_to_the_echo_floor(tmp_path: Path) -> None:
    with (
        running(module_argv("perf.echo_server")) as echo,
        running(module_argv("perf.bare_proxy", "--backend", echo.address)) as proxy,
    ):
        out = tmp_path / "open"
        sweep(
            "--target", proxy.address, "--rps", "100,200", "-z", "1s", "--warmup", "0",
            "--quiet", "--out", str(out),
        )  # fmt: skip
    levels = json.loads(out.with_suffix(".json").read_text())["levels"]
    assert [(lv["mode"], lv["value"], lv["calls"], lv["ok"]) for lv in levels] == [
        ("rate", 100, 100, 100),
        ("rate", 200, 200, 200),
    ]
    for lv in levels:
        # Calls go out on the schedule, never ahead of it, however fast the answers come: the
        # last is sent (calls - 1) / rate after the first. How close a busy machine keeps to
        # the rate is no behaviour of the sweep (the unit tests check the schedule exactly).
        assert lv["wall_s"] >= (lv["calls"] - 1) / lv["value"]
        assert lv["throughput"] == pytest.approx(lv["calls"] / lv["wall_s"])
        # Any local process is measured: here the proxy, not the echo behind it.
        assert lv["target_cpu"]["pids"] == [proxy.pid] and lv["target_cpu"]["per_call_ms"] > 0


@pytest.mark.parametrize(
    "extra", [["--call", "stream"], ["--embedded"]], ids=["stream", "embedded"]
)
def test_sweep_streaming_and_embedded_modes(
    server: Process, tmp_path: Path, extra: list[str]
) -> None:
    out = tmp_path / "mode"
    target = server.address if extra[0] == "--call" else f"{server.address},127.0.0.1:1"
    sweep(
        "--target", target, "-c", "4", "-n", "200", "--warmup", "0", "--quiet", "--unique",
        "--out", str(out), *extra,
    )  # fmt: skip
    (level,) = json.loads(out.with_suffix(".json").read_text())["levels"]
    assert level["calls"] == level["ok"] == 200, level["statuses"]


def test_the_h2load_engine_says_what_it_needs(server: Process) -> None:
    # Without h2load on PATH (only the venv's programs): a clear message, not a traceback.
    missing = subprocess.run(
        [str(BIN / "sluice"), "perf", "--target", server.address, "--engine", "h2load"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(BIN)},
    )
    assert missing.returncode == 2 and "needs h2load on PATH" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load (nghttp2-client) is not here")
def test_the_h2load_engine_sweeps_like_the_python_one(tmp_path: Path) -> None:
    with running(server_argv("--cache-entries", "0", node_id="h2")) as target:
        out = tmp_path / "h2"
        done = sweep(
            "--target", target.address, "--engine", "h2load", "-c", "1,8", "-z", "1s",
            "--warmup", "0.2s", "--out", str(out),
        )  # fmt: skip
        assert "c=1" in done.stdout and "c=8" in done.stdout
        levels = json.loads(out.with_suffix(".json").read_text())["levels"]
        for lv in levels:
            assert lv["calls"] > 50 and lv["ok"] == lv["calls"], lv["statuses"]
            lat = lv["latency"]
            assert 0 < lat["min"] <= lat["p50"] <= lat["p99"] <= lat["max"] < 10_000
            assert lv["server"]["requests"] >= lv["calls"]  # the server saw them all
            assert lv["target_cpu"]["pids"] == [target.pid]
            assert lv["target_cpu"]["per_call_ms"] > 0
        assert "| target cpu/call |" in out.with_suffix(".md").read_text()
        refused = subprocess.run(
            [
                str(BIN / "sluice"),
                "perf",
                "--target",
                target.address,
                "--engine=h2load",
                "--unique",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and "--cache-entries 0" in refused.stderr
