"""What TLS costs on both hops, side by side in one run, against the same kind of server:

  direct-plain     client -> server, plaintext
  direct-tls       client -> server, mutual TLS
  balancer-plain   client -> sluice-balancer -> server, plaintext on both hops
  balancer-tls     client -> sluice-balancer -> server, mutual TLS on both hops

  python -m perf.tls --rounds 3 --duration 4s --levels 1,32 --h2load

Certificates from a throwaway CA (EC P-256, TLS 1.3 as grpc negotiates it); the servers'
cache is off and the Python load generator sends unique inputs, so every call runs the
model; its connections stay open for a level, so the figures are the cost per call, not per
handshake. With --h2load (when installed) the same four paths again driven by h2load, which
cannot show a client certificate: its TLS paths end at listeners that do not ask for one
(the balancer still shows its own to the server). The configurations alternate round by
round; each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from perf import paired
from perf.certs import Authority, Pair
from perf.launch import BIN, Process, server_argv
from sluice.perf import h2engine
from sluice.runtime.tls import ClientTLS, blocking_channel


def loopback(address: str) -> str:
    """Where to connect to a process that announced `address`: one listening on every address
    (0.0.0.0) is reached on 127.0.0.1."""
    return address.replace("0.0.0.0:", "127.0.0.1:", 1)


@contextmanager
def running_tls(
    argv: Sequence[str], tls: ClientTLS | None, *, start_s: float = 30.0
) -> Iterator[Process]:
    """A process for the length of the block, from the moment its health check, reached with
    `tls` (None: plaintext), says SERVING; killed by its pid afterwards."""
    proc = Process(argv, start_s=start_s)
    try:
        with blocking_channel(loopback(proc.address), tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True
            )
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{proc.address} is not serving:\n{proc.log()}")
        yield proc
    finally:
        proc.kill()


def mutual(ca: Authority, pair: Pair) -> list[str]:
    """The flags of a listener that serves `pair` and requires client certificates from `ca`."""
    return [
        "--tls-cert",
        str(pair.cert),
        "--tls-key",
        str(pair.key),
        "--tls-client-ca",
        str(ca.cert),
    ]


def client_flags(ca: Authority, pair: Pair) -> list[str]:
    """The sweep's flags for mutual TLS with `pair`."""
    return ["--tls-ca", str(ca.cert), "--tls-cert", str(pair.cert), "--tls-key", str(pair.key)]


def compare(runs: dict[str, list[dict[str, Any]]], levels: list[str]) -> dict[str, Any]:
    """The medians of each path, and TLS against plaintext on each: the first level's p50
    (ratio, and the milliseconds added) and the last level's calls/s (ratio)."""
    idle, busy = f"c{levels[0]}", f"c{levels[-1]}"
    result = paired.summary(runs, levels)
    for path in ("direct", "balancer"):
        plain, tls = result[f"{path}-plain"], result[f"{path}-tls"]
        result[f"{path}_tls_vs_plain"] = {
            f"{idle}_p50": tls[idle]["p50"] / plain[idle]["p50"],
            f"{idle}_added_p50_ms": tls[idle]["p50"] - plain[idle]["p50"],
            f"{busy}_throughput": tls[busy]["throughput"] / plain[busy]["throughput"],
        }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.tls", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", default="4s")
    parser.add_argument("--levels", default="1,32", help="concurrency: idle, then saturated")
    parser.add_argument("--h2load", action="store_true", help="also drive them with h2load")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    h2load = args.h2load and h2engine.available()
    common = ["-c", args.levels, "-z", args.duration, "--warmup", "1s"]
    server = ["--device", "cpu", "--cache-entries", "0"]
    balancer = [str(BIN / "sluice-balancer"), "--port", "0"]
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        ca = Authority(Path(folder))
        client = ca.issue("client")
        upstream = ca.issue("balancer-upstream")
        reach = ClientTLS.of(ca=str(ca.cert), cert=str(client.cert), key=str(client.key))

        def start(argv: list[str], tls: ClientTLS | None) -> str:
            return str(stack.enter_context(running_tls(argv, tls)).address)

        upstream_tls = [
            "--upstream-tls-ca", str(ca.cert),
            "--upstream-tls-cert", str(upstream.cert), "--upstream-tls-key", str(upstream.key),
        ]  # fmt: skip
        plain_server = start(server_argv(*server, node_id="plain"), None)
        tls_server = start(
            server_argv(*server, *mutual(ca, ca.issue("server")), node_id="tls"), reach
        )
        plain_balancer = start([*balancer, "--backend", plain_server], None)
        tls_balancer = start(
            [*balancer, "--backend", tls_server, *mutual(ca, ca.issue("balancer")), *upstream_tls],
            reach,
        )
        secure = client_flags(ca, client)
        configs: dict[str, tuple[str, list[str]]] = {
            "direct-plain": (plain_server, []),
            "direct-tls": (tls_server, secure),
            "balancer-plain": (plain_balancer, []),
            "balancer-tls": (tls_balancer, secure),
        }
        runs = paired.alternate(configs, [*common, "--unique"], args.rounds, "tls")
        if h2load:
            # Listeners that ask no client certificate, before the same servers' kind.
            trust = ClientTLS.of(ca=str(ca.cert))
            pair = ca.issue("one-way")
            one_way = ["--tls-cert", str(pair.cert), "--tls-key", str(pair.key)]
            tls1_server = start(server_argv(*server, *one_way, node_id="tls1"), trust)
            tls1_balancer = start(
                [*balancer, "--backend", tls_server, *one_way, *upstream_tls], trust
            )
            ca_only = ["--tls-ca", str(ca.cert)]
            h2_configs: dict[str, tuple[str, list[str]]] = {
                "direct-plain": (plain_server, []),
                "direct-tls": (tls1_server, ca_only),
                "balancer-plain": (plain_balancer, []),
                "balancer-tls": (tls1_balancer, ca_only),
            }
            h2_runs = paired.alternate(
                h2_configs, [*common, "--engine", "h2load"], args.rounds, "tls h2load"
            )
    levels = args.levels.split(",")
    result: dict[str, Any] = {"command": "python -m perf.tls " + " ".join(argv or sys.argv[1:])}
    result["python"] = compare(runs, levels)
    if h2load:
        result["h2load"] = compare(h2_runs, levels)
    result["saturated"] = paired.saturated(runs)
    print(paired.save(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
