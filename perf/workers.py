"""`sluice-server --workers`: one process against two on this machine, side by side, with
h2load (several connections, so the kernel spreads them over the processes), and the
server's CPU time per call, from which what N workers give on N free cores follows.

  python -m perf.workers --rounds 4 --calls 20000

The bundled digits model, cache off (every call runs the model). The load generator shares
the machine's cores with the servers: read the measured gain as a floor, and the CPU per
call as what a core can give.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from perf import paired
from perf.launch import Process, children, cpu_seconds, running, server_argv
from sluice import models
from sluice.perf import h2engine
from sluice.perf.sweep import request_body

PREDICT = "/sluice.v1.Inference/Predict"


def processes(server: Process, count: int, timeout: float = 60.0) -> list[int]:
    """The server's processes: the first and its workers, once all are there (bounded)."""
    deadline = time.monotonic() + timeout
    while len(found := [server.pid, *children(server.pid)]) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"{server.address}: {count - 1} workers did not start")
        time.sleep(0.05)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.workers", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20_000, help="calls per round")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--streams", type=int, default=8, help="in flight per connection")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    body = request_body(models.samples()[0].input, "input", "predict", "")
    rates: dict[str, list[float]] = {"1": [], "2": []}
    cpu: dict[str, list[float]] = {"1": [], "2": []}
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        framed = h2engine.frame(body, folder / "body")
        servers = {
            n: stack.enter_context(
                running(server_argv("--cache-entries", "0", "--workers", n, node_id=f"w{n}"))
            )
            for n in rates
        }
        pids = {n: processes(servers[n], int(n)) for n in rates}
        for r in range(args.rounds):
            for n in list(rates)[:: 1 if r % 2 == 0 else -1]:
                before = cpu_seconds(pids[n])
                rate = h2engine.calls_per_s(
                    servers[n].address, PREDICT, framed, args.calls, args.connections, args.streams
                )
                rates[n].append(rate)
                cpu[n].append((cpu_seconds(pids[n]) - before) / args.calls * 1e6)
                print(f"workers round {r + 1}/{args.rounds}: {n} done", file=sys.stderr)
    one, two = (statistics.median(rates[n]) for n in ("1", "2"))
    per_call = statistics.median(cpu["1"])
    result: dict[str, Any] = {
        "command": "python -m perf.workers " + " ".join(argv or sys.argv[1:]),
        "calls_per_s": rates,
        "server_cpu_us_per_call": cpu,
        "workers_2_vs_1": two / one,
        # A worker needs `per_call` of a core a call: N free cores give N / per_call.
        "on_n_free_cores_calls_per_s": {n: n * 1e6 / per_call for n in (1, 2, 4, 8, 16)},
    }
    print(paired.save(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
