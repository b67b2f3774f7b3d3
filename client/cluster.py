"""`sluice up`: a local cluster in the foreground: N servers on consecutive ports behind one
balancer. Ctrl-C (or SIGTERM) stops all of them cleanly, balancer first."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

import grpc

from sluice.runtime.launch import BIN, wait_serving


def free_ports(host: str, count: int) -> list[int]:
    """Ports nothing listens on now (held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice up", description=__doc__)
    p.add_argument("--model", default="", help="ONNX model for every server (default: bundled)")
    p.add_argument("--servers", type=int, default=3, help="how many servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=8000, help="the balancer; servers take the next (0: any free)"
    )
    p.add_argument("--server-arg", action="append", default=[], help="extra sluice-server flag")
    p.add_argument("--balancer-arg", action="append", default=[], help="extra balancer flag")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.servers < 1:
        raise SystemExit("--servers must be at least 1")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    servers: list[subprocess.Popen[bytes]] = []
    balancer: subprocess.Popen[bytes] | None = None
    if args.port == 0:  # free ports, for tests and for running beside something else
        args.port, *ports = free_ports(args.host, args.servers + 1)
    else:
        ports = [args.port + i for i in range(1, args.servers + 1)]
    addresses = [f"{args.host}:{port}" for port in ports]
    # Children ignore the terminal's Ctrl-C; we stop them in order ourselves.
    detach = {"start_new_session": True}
    try:
        for i, address in enumerate(addresses, 1):
            servers.append(
                subprocess.Popen(
                    [str(BIN / "sluice-server"), "--host", args.host]
                    + (["--model", args.model] if args.model else [])
                    + ["--port", address.rsplit(":", 1)[1], "--node-id", f"server-{i}"]
                    + [a for arg in args.server_arg for a in arg.split()],
                    **detach,  # type: ignore[call-overload]
                )
            )
        for address in addresses:
            wait_serving(address, 60.0)
        balancer = subprocess.Popen(
            [str(BIN / "sluice-balancer"), "--host", args.host, "--port", str(args.port)]
            + [a for address in addresses for a in ("--backend", address)]
            + [a for arg in args.balancer_arg for a in arg.split()],
            **detach,  # type: ignore[call-overload]
        )
        wait_serving(f"{args.host}:{args.port}", 60.0)
        print(
            f"sluice up: balancer on {args.host}:{args.port} -> servers on "
            + ", ".join(addresses)
            + " (Ctrl-C stops them)",
            flush=True,
        )
        while not stop.wait(0.5):
            for proc in [*servers, balancer]:
                if proc.poll() is not None:
                    print(f"sluice up: pid {proc.pid} exited with {proc.returncode}", flush=True)
                    stop.set()
    except (RuntimeError, grpc.RpcError) as exc:
        print(f"sluice up: {exc}", file=sys.stderr)
        return 1
    finally:
        failed = stop_all([p for p in [balancer, *servers] if p is not None])
    return 1 if failed else 0


def stop_all(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> bool:
    """SIGTERM each, balancer first, and wait; True when one had to be killed."""
    killed = False
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed = True
    return killed


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
