"""`python -m perf.faults`: the fault suite. Each scenario starts real processes on
127.0.0.1 (servers on the CPU, a balancer), drives load from load-generator processes,
injects one fault, and prints one table; a summary table follows, and `--out` writes JSON.

  python -m perf.faults                       # every scenario, a few minutes
  python -m perf.faults --scenario sigstop --scenario burst
  python -m perf.faults --quick --out faults.json

Scenarios: kill9, sigterm, sigstop (a server killed, drained, hung and resumed behind the
balancer), failing-model (a server whose model fails every call), bad-flood (hostile calls
mixed with valid ones), slow-reader (a PredictStream caller that never reads), burst (2,000
calls at once), overload (open loop at 1.5x and 2x of capacity, 100 ms deadlines),
kill-worker (a balancer worker killed under load).

Every process is stopped by its pid when its scenario ends; every load loop is bounded in
calls and in time. Latency counts from a call's scheduled send time (open loop) or its send
(closed loop); a call's record keeps its start, so phases split on when calls began.
The sweep's load generator (`sluice.perf.loadgen`) keeps one histogram for all statuses;
these scenarios need latency by status and the node that answered each call, so the
driver (perf/drive.py) is a thin one over the same request bodies (`loadgen.Bodies`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from perf.bench import LOAD_PROCS, Bench
from perf.faults.burst import burst
from perf.faults.crash import kill9, sigterm
from perf.faults.failing import failing
from perf.faults.flood import bad_flood
from perf.faults.kill_worker import kill_worker
from perf.faults.overload import overload
from perf.faults.results import Outcome, render, render_summary
from perf.faults.sigstop import sigstop
from perf.faults.slow_reader import slow_reader
from sluice.perf import loadgen

SCENARIOS: dict[str, Callable[[Bench], Outcome]] = {
    "kill9": kill9,
    "sigterm": sigterm,
    "sigstop": sigstop,
    "failing-model": failing,
    "bad-flood": bad_flood,
    "slow-reader": slow_reader,
    "burst": burst,
    "overload": overload,
    "kill-worker": kill_worker,
}


def run_one(name: str, pool: ProcessPoolExecutor, quick: bool) -> Outcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"sluice-faults-{name}-") as scratch:
        bench = Bench(pool, Path(scratch), quick)
        try:
            outcome = SCENARIOS[name](bench)
        except Exception as exc:  # one scenario's failure is reported; the others still run
            outcome = Outcome(name, "did not complete", error=f"{type(exc).__name__}: {exc}")
            logs = [f"--- {n}\n{p.log()[-2000:]}" for n, p in bench.procs.items()]
            outcome.facts["logs"] = "\n".join(logs)
        finally:
            bench.stop_all()
    outcome.wall_s = time.monotonic() - started
    return outcome


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf.faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenario", action="append", choices=list(SCENARIOS), help="repeatable; default all"
    )
    p.add_argument("--quick", action="store_true", help="shorter loads (for tests)")
    p.add_argument("--out", default="", help="write the results as JSON to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    outcomes = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=LOAD_PROCS, mp_context=context) as pool:
        list(pool.map(loadgen.ready, [0.2] * LOAD_PROCS))  # start them all before any load
        for name in names:
            outcome = run_one(name, pool, args.quick)
            outcomes.append(outcome)
            print(render(outcome), flush=True)
            print(flush=True)
    print(render_summary(outcomes), flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "command": " ".join(["python -m perf.faults", *(argv or sys.argv[1:])]),
                    "quick": args.quick,
                    "cpus": os.cpu_count(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "scenarios": [asdict(o) for o in outcomes],
                },
                indent=2,
                default=str,
            )
        )
        print(f"wrote {args.out}")
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
