"""h2load (nghttp2's C client) as the sweep's load generator: on a small machine a Python
generator measures itself as much as the target.

It replays one body and sees HTTP statuses only, so one real call checks the gRPC status
before each level. Closed loop only: h2load's `-r` paces connections, not calls."""

from __future__ import annotations

import math
import re
import resource
import shutil
import struct
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc

from sluice.client.connect import PLAINTEXT, Connection
from sluice.client.core import auth_metadata
from sluice.perf import histograms
from sluice.perf.loadgen import LevelResult
from sluice.runtime.tls import blocking_channel

GRPC = ("-H", "content-type: application/grpc", "-H", "te: trailers")
MISSING = (
    "--engine h2load needs h2load on PATH (Debian/Ubuntu: apt-get install nghttp2-client); "
    "or use --engine python"
)


def request_args(address: str, method: str, connection: Connection) -> list[str]:
    """h2load's headers and URI for one target: https with TLS (h2load checks no server
    certificate and shows no client certificate), and the API key."""
    headers = [("-H", f"{name}: {value}") for name, value in auth_metadata(connection.api_key)]
    scheme = "https" if connection.secure else "http"
    return [*GRPC, *(arg for pair in headers for arg in pair), f"{scheme}://{address}{method}"]


def frame(body: bytes, path: Path) -> Path:
    """Write `body` as one gRPC message (uncompressed, length-prefixed) for h2load's -d."""
    path.write_bytes(b"\0" + struct.pack(">I", len(body)) + body)
    return path


def calls_per_s(
    address: str,
    method: str,
    framed: Path,
    calls: int,
    connections: int,
    streams: int,
    connection: Connection = PLAINTEXT,
) -> float:
    """h2load's rate for `calls` calls of the framed body, `streams` in flight on each of
    `connections`; every call must have been answered (HTTP 2xx)."""
    load = ["-n", str(calls), "-c", str(connections), "-m", str(streams), "-d", str(framed)]
    out = subprocess.run(
        ["h2load", *load, *request_args(address, method, connection)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    assert found and f"{calls} 2xx" in out, out
    return float(found[1])


def available() -> bool:
    return shutil.which("h2load") is not None


def check_call(
    target: str, method: str, body: bytes, timeout: float, connection: Connection = PLAINTEXT
) -> None:
    """One real gRPC call of the body: h2load would count a refusal as an answer. With TLS it
    also checks the server's certificate, which h2load does not."""
    with blocking_channel(target, connection.client_tls()) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(body, timeout=timeout, metadata=auth_metadata(connection.api_key))
        except grpc.RpcError as exc:
            raise SystemExit(
                f"the body h2load would replay fails at {target}: "
                f"{exc.code().name}: {exc.details()}"
            ) from None


def run_level(
    target: str,
    method: str,
    body: bytes,
    concurrency: int,
    connections: int,
    duration: float,
    warmup: float,
    connection: Connection = PLAINTEXT,
    warmed: Callable[[], None] | None = None,
) -> LevelResult:
    """One closed-loop level: `concurrency` calls in flight over `connections` connections
    for `duration` seconds after `warmup`; latencies from h2load's per-request log. `warmed`
    is called when the warm-up ends (by this clock: h2load tells nothing while it runs)."""
    connections = max(1, min(connections, concurrency))
    streams = math.ceil(concurrency / connections)
    with tempfile.TemporaryDirectory() as folder:
        framed, log = frame(body, Path(folder) / "body"), Path(folder) / "log"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        argv = ["h2load", "-c", str(connections), "-m", str(streams)]
        argv += ["-D", f"{round(duration * 1000)}ms", "--warm-up-time", f"{round(warmup * 1000)}ms"]
        argv += ["-d", str(framed), "--log-file", str(log)]
        argv += request_args(target, method, connection)
        h2load = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = h2load.communicate(timeout=warmup)
        except subprocess.TimeoutExpired:  # the warm-up is over: the measured time begins
            if warmed is not None:
                warmed()
            stdout, stderr = h2load.communicate()
        if h2load.returncode != 0:
            raise SystemExit(f"h2load failed ({h2load.returncode}): {stderr or stdout}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        histogram = histograms.new_histogram()
        statuses: Counter[str] = Counter()
        for line in log.read_text().splitlines():
            _, status, micros = line.split("\t")
            statuses["OK" if status.startswith("2") else f"HTTP {status}"] += 1
            histograms.record(histogram, int(micros) / 1e6)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return LevelResult(
        histogram=histogram.encode(),
        statuses=statuses,
        wall_s=duration,
        cpu_s=cpu,
    )
