"""The per-node speed table with h2load, side by side in one run: the echo floor, the server with
its cache off (every call runs the model) and answering from its cache (h2load replays one
body), and the server behind the balancer, at 1 and 32 calls in flight.

  python -m perf.baseline --rounds 3 --duration 3s

The bundled digits model; `sluice perf --engine h2load` for every cell; medians over rounds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from perf import paired
from perf.launch import BIN, module_argv, running, server_argv
from sluice.perf import h2engine


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.baseline", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", default="3s")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if not h2engine.available():
        raise SystemExit(h2engine.MISSING)
    levels = ["1", "32"]
    common = ["--engine", "h2load", "-c", ",".join(levels), "-z", args.duration]
    common += ["--warmup", "1s"]
    with ExitStack() as stack:
        echo = stack.enter_context(running(module_argv("perf.echo_server")))
        off = stack.enter_context(running(server_argv("--cache-entries", "0", node_id="off")))
        hits = stack.enter_context(running(server_argv(node_id="hits")))
        balancer = stack.enter_context(
            running([str(BIN / "sluice-balancer"), "--port", "0", "--backend", off.address])
        )
        configs: dict[str, tuple[str, list[str]]] = {
            "echo": (echo.address, []),
            "server": (off.address, []),
            "server-cache-hits": (hits.address, []),
            "balancer": (balancer.address, []),
        }
        runs = paired.alternate(configs, common, args.rounds, "baseline")
    result: dict[str, Any] = {
        "command": "python -m perf.baseline " + " ".join(argv or sys.argv[1:])
    }
    result.update(paired.summary(runs, levels))
    echo_cells, server_cells = result["echo"], result["server"]
    result["server_vs_echo_c32"] = (
        server_cells["c32"]["throughput"] / echo_cells["c32"]["throughput"]
    )
    result["hits_vs_echo_c32"] = (
        result["server-cache-hits"]["c32"]["throughput"] / echo_cells["c32"]["throughput"]
    )
    result["hop_added_p50_ms_c1"] = result["balancer"]["c1"]["p50"] - server_cells["c1"]["p50"]
    result["hop_vs_direct_c32"] = (
        result["balancer"]["c32"]["throughput"] / server_cells["c32"]["throughput"]
    )
    print(paired.save(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
