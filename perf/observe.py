"""What seeing inside costs: one server per configuration (nothing on; Prometheus metrics on;
tracing at 1% and at 100% of calls), swept side by side in alternating rounds, medians over
rounds, ratios against nothing on. Tracing exports with the console exporter into the
server's discarded stdout, so no collector is needed (an OTLP exporter costs about the same
on the server: the span's making dominates).

  python -m perf.observe --rounds 5 -c 16 -z 4s
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

from perf import paired
from perf.launch import Process, server_argv

TRACING = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def configurations() -> dict[str, tuple[list[str], dict[str, str]]]:
    return {
        "off": ([], {}),
        "metrics": (["--metrics-port", str(free_port())], {}),
        "tracing 1%": ([], {**TRACING, "OTEL_TRACES_SAMPLER_ARG": "0.01"}),
        "tracing 100%": ([], {**TRACING, "OTEL_TRACES_SAMPLER_ARG": "1.0"}),
    }


@contextmanager
def started(name: str, extra: Sequence[str], env: dict[str, str]) -> Iterator[Process]:
    proc = Process(server_argv("--device", "cpu", *extra, "--port", "0", node_id=name), env)
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.kill()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.observe", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-c", "--concurrency", default="16")
    parser.add_argument("-z", "--duration", default="4s")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    sweep = ["--unique", "-c", args.concurrency, "-z", args.duration, "--warmup", "1s"]
    with ExitStack() as stack:
        targets = {
            name: stack.enter_context(started(name, extra, env)).address
            for name, (extra, env) in configurations().items()
        }
        runs = paired.rounds(targets, sweep, args.rounds, label="observe")
    base = paired.median(runs["off"], 0, "throughput")
    result = {
        name: {
            "throughput": paired.median(r, 0, "throughput"),
            "p50_ms": paired.median(r, 0, "p50"),
            "ratio": paired.median(r, 0, "throughput") / base,
        }
        for name, r in runs.items()
    }
    print(f"{'configuration':14} {'calls/s':>9} {'p50 ms':>8} {'vs off':>7}")
    for name, row in result.items():
        print(f"{name:14} {row['throughput']:9.0f} {row['p50_ms']:8.2f} {row['ratio']:7.3f}")
    if paired.saturated(runs):
        print("warning: the load generator was saturated in some round", file=sys.stderr)
    paired.save({"rounds": args.rounds, "sweep": sweep, "result": result}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
