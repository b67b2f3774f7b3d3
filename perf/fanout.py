"""Fan-out, side by side in one run: the same many-row Predict on a compute-heavy MLP
(perf/make_mlp.py), one call at a time, through

  one-server  a balancer with one server behind it, no fan-out
  fan-out     a balancer with --servers servers behind it and --fanout-rows (each chunk a
              call of its own, in parallel)
  one-chunk   the one-server balancer, a request of --fanout-rows rows: what one chunk costs
              alone (the per-chunk time the paper figure below is built from)

every server with `--intra-op-threads 1` (one core a server) and its cache off, in
alternating rounds. Percentiles are over every call of a configuration.

A machine with fewer cores than servers runs only that many chunks at once: the fan-out
figure measured here is then bounded by the cores (`p50_bound_by_these_cores`: the chunks in
waves of one a core, each the one-chunk p50). The paper figure says what the same servers
would give with a core each (`p50_a_core_a_server`): per fan-out call, the most chunks any
one server got (from the x-node-id trailer) times the one-chunk p50, plus the balancer's
split and merge (timed in this process).

  python -m perf.fanout --rounds 5 --calls 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import grpc
import numpy as np

from perf import make_mlp, paired
from perf.launch import BIN, running, server_argv
from sluice.balancer import fanout
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

PREDICT = "/sluice.v1.Inference/Predict"


def body(rows: int, seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)
    return pb.PredictRequest(inputs=[codec.encode("input", x)]).SerializeToString()


def call(channel: grpc.Channel, request: bytes) -> tuple[float, str]:
    """One Predict: its latency in ms and the x-node-id trailer."""
    predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
    started = time.perf_counter()
    _, answer = predict.with_call(request, timeout=60)
    elapsed = (time.perf_counter() - started) * 1000
    trailers = dict(answer.trailing_metadata() or ())
    return elapsed, str(trailers.get("x-node-id", ""))


def split_merge_ms(request: bytes, most: int, repeat: int = 50) -> float:
    """The balancer's own work on a fanned-out call (split, then merge of answers of the
    MLP's output size), median ms, in this process."""
    parts = fanout.split(request, most)
    assert parts is not None
    answers = [
        pb.PredictResponse(
            model="m",
            version="1",
            outputs=[codec.encode("output", np.zeros((b - a, 10), np.float32))],
        ).SerializeToString()
        for a, b in parts.bounds
    ]
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        again = fanout.split(request, most)
        assert again is not None
        fanout.merge(answers, again)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q))


def summary(latencies: list[float]) -> dict[str, float]:
    return {
        "calls": len(latencies),
        "p50": percentile(latencies, 50),
        "p90": percentile(latencies, 90),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.fanout", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="calls per configuration a round")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--fanout-rows", type=int, default=64)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    model = make_mlp.cached(args.width, args.depth)
    common = ("--intra-op-threads", "1", "--cache-entries", "0", "--device", "cpu")
    requests = {
        "one-server": body(args.rows, 1),
        "fan-out": body(args.rows, 1),
        "one-chunk": body(args.fanout_rows, 2),
    }
    latencies: dict[str, list[float]] = {name: [] for name in requests}
    placements: Counter[int] = Counter()  # fan-out calls by the most chunks on one server
    with ExitStack() as stack:
        servers = [
            stack.enter_context(running(server_argv(*common, node_id=f"s{i}", model=model)))
            for i in range(args.servers)
        ]
        balancer = [str(BIN / "sluice-balancer"), "--port", "0"]
        single = stack.enter_context(running([*balancer, "--backend", servers[0].address]))
        fanned = [*balancer, "--fanout-rows", str(args.fanout_rows)]
        for server in servers:
            fanned += ["--backend", server.address]
        spread = stack.enter_context(running(fanned))
        channels = {
            "one-server": stack.enter_context(grpc.insecure_channel(single.address)),
            "fan-out": stack.enter_context(grpc.insecure_channel(spread.address)),
        }
        channels["one-chunk"] = channels["one-server"]
        for name, request in requests.items():  # warm up: sessions, connections, estimates
            for _ in range(3):
                call(channels[name], request)
        names = list(requests)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                for _ in range(args.calls):
                    elapsed, nodes = call(channels[name], requests[name])
                    latencies[name].append(elapsed)
                    if name == "fan-out":
                        placements[max(Counter(nodes.split(",")).values())] += 1
            print(f"fanout round {r + 1}/{args.rounds} done", file=sys.stderr)
    result: dict[str, Any] = {
        "command": "python -m perf.fanout " + " ".join(argv or sys.argv[1:]),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    for name, measured in latencies.items():
        result[name] = summary(measured)
    one, fan, chunk = (result[n]["p50"] for n in ("one-server", "fan-out", "one-chunk"))
    result["ratio_p50"] = fan / one
    result["ratio_p90"] = result["fan-out"]["p90"] / result["one-server"]["p90"]
    overhead = split_merge_ms(requests["fan-out"], args.fanout_rows)
    result["split_merge_ms"] = overhead
    result["most_chunks_on_one_server"] = dict(sorted(placements.items()))
    chunks = -(-args.rows // args.fanout_rows)
    cores = os.cpu_count() or 1
    # A server a core: per call, its busiest server's chunks one after another.
    paper = sorted(m * chunk + overhead for m, n in placements.items() for _ in range(n))
    bound = -(-chunks // min(cores, args.servers)) * chunk + overhead
    result["paper"] = {
        "p50_a_core_a_server": percentile(paper, 50),
        "ratio_a_core_a_server": percentile(paper, 50) / one,
        # What these cores allow at best: the chunks in waves of one a core.
        "p50_bound_by_these_cores": bound,
        "ratio_bound_by_these_cores": bound / one,
    }
    print(paired.save(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
