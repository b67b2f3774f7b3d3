"""Where the installed commands are and when a started one serves: what `sluice up` needs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# sluice-server, sluice-balancer and sluice sit beside this interpreter.
BIN = Path(sys.executable).parent


def wait_serving(
    address: str,
    timeout: float = 30.0,
    *,
    require: bool = True,
    abandon: Callable[[], bool] | None = None,
    poll_s: float = 0.1,
) -> bool:
    """Wait until `address` answers its health check: True, or RuntimeError unless SERVING
    (with `require`) or on no answer in `timeout`. False once `abandon()` says so (asked
    every `poll_s`: the process exited)."""
    with grpc.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Check.future(
            health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True
        )
        try:
            while True:
                try:
                    reply = call.result(timeout=poll_s)
                    break
                except grpc.FutureTimeoutError:
                    if abandon is not None and abandon():
                        call.cancel()
                        return False
        except grpc.RpcError:
            if call.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RuntimeError(f"{address} did not answer in {timeout:g} s") from None
            raise RuntimeError(f"{address}: {call.code().name} {call.details()}") from None
    if require and reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise RuntimeError(f"{address} is not serving")
    return True
