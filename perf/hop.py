"""The balancer hop, side by side in one run, each with the same one server behind it:

  direct           client -> server (unary Predict)
  direct-stream    client -> server over PredictStream (multiplexed)
  embedded         client with its own balancing (the planner, as SluiceClient) -> server
  balancer         client -> sluice-balancer -> server
  balancer-stream  client -> sluice-balancer over PredictStream -> server
  bare-proxy       client -> perf/bare_proxy.py (raw bytes, unary) -> server
  nginx            client -> nginx grpc_pass -> server (when nginx is installed)

  python -m perf.hop --rounds 2 --duration 4s --levels 1,32

Unique inputs, so the server computes every call; one load-generator process.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from perf import paired
from perf.launch import BIN, module_argv, running, server_argv

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  upstream sluice {{ server {backend}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port} http2;
    location / {{ grpc_pass grpc://sluice; }}
  }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def nginx(backend: str) -> Iterator[str]:
    """nginx as a gRPC proxy in front of `backend`, stopped by its pid afterwards."""
    with tempfile.TemporaryDirectory() as folder:
        port = free_port()
        conf = Path(folder) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=folder, backend=backend, port=port))
        proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", folder], stdin=subprocess.DEVNULL)
        address = f"127.0.0.1:{port}"
        try:
            with grpc.insecure_channel(address) as channel:
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True
                )
            yield address
        finally:
            proc.terminate()
            proc.wait(10)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.hop", description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", default="4s")
    parser.add_argument("--levels", default="1,32", help="concurrency: idle, then saturated")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    common = ["-c", args.levels, "-z", args.duration, "--warmup", "1s", "--unique"]
    with ExitStack() as stack:
        server = stack.enter_context(running(server_argv("--device", "cpu", node_id="s")))
        balancer = stack.enter_context(
            running([str(BIN / "sluice-balancer"), "--port", "0", "--backend", server.address])
        )
        proxy = stack.enter_context(
            running(module_argv("perf.bare_proxy", "--backend", server.address))
        )
        configs: dict[str, tuple[str, list[str]]] = {
            "direct": (server.address, []),
            "direct-stream": (server.address, ["--call", "stream"]),
            "embedded": (server.address, ["--embedded"]),
            "balancer": (balancer.address, []),
            "balancer-stream": (balancer.address, ["--call", "stream"]),
            "bare-proxy": (proxy.address, []),
        }
        if shutil.which("nginx"):
            configs["nginx"] = (stack.enter_context(nginx(server.address)), [])
        runs = paired.alternate(configs, common, args.rounds, "hop")
    levels = args.levels.split(",")
    result: dict[str, Any] = {"command": "python -m perf.hop " + " ".join(argv or sys.argv[1:])}
    result.update(paired.summary(runs, levels))
    idle, busy = f"c{levels[0]}", f"c{levels[-1]}"
    direct = result["direct"]
    for name in runs:
        result[name]["added_p50_ms"] = result[name][idle]["p50"] - direct[idle]["p50"]
        result[name]["throughput_vs_direct"] = (
            result[name][busy]["throughput"] / direct[busy]["throughput"]
        )
    result["saturated"] = paired.saturated(runs)
    print(paired.save(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
