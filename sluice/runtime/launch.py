"""Where the installed commands are and when a started one serves: what `sluice up` needs to
start a local cluster (the benchmarks' and tests' harness is the checkout's perf/launch.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# sluice-server, sluice-balancer and sluice sit beside this interpreter.
BIN = Path(sys.executable).parent


def wait_serving(address: str, timeout: float = 30.0, *, require: bool = True) -> None:
    """Until the process at `address` answers its grpc.health.v1 check; RuntimeError unless
    it says SERVING (with `require`)."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True
        )
    if require and reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"{address} is not serving")
