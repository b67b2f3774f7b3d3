"""`sluice up`: a local cluster in the foreground: N servers on consecutive ports behind one
balancer. Ctrl-C (or SIGTERM) stops all of them cleanly, balancer first. A port that is
taken is said before any starts; when one cannot start, or Ctrl-C comes before all serve,
every one started stops at once and one line says which and why."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from sluice.core.errors import SluiceError
from sluice.runtime.launch import BIN, wait_serving
from sluice.runtime.listener import check_port_free

START_S = 60.0  # for a server (it loads its models first) or the balancer to serve
STARTING_STOP_S = 5.0  # a process that never served has no calls to finish
SERVING_STOP_S = 30.0  # one that served drains its calls
READ_S = 2.0  # for the rest of an exited child's output (a process it left may hold the pipe)
ERROR_LEVELS = ("ERROR", "CRITICAL")


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


def error_message(line: str) -> str | None:
    """The message of an ERROR or CRITICAL log line of a Sluice process, in either log format
    (sluice.runtime.process); None for any other line."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return None
        if isinstance(record, dict) and record.get("level") in ERROR_LEVELS:
            return str(record.get("message", ""))
        return None
    fields = line.split(" ", 4)  # date, time, level, logger, message
    if len(fields) == 5 and fields[2] in ERROR_LEVELS:
        return fields[4].strip()
    return None


class Child:
    """A server or the balancer, in its own session: the terminal's Ctrl-C comes to us and we
    stop the children in order. Its stderr goes on to ours as it comes; the last error line is
    kept, to say why it stopped."""

    def __init__(self, name: str, address: str, argv: list[str]) -> None:
        self.name, self.address = name, address
        self.proc = subprocess.Popen(
            argv, stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True
        )
        self._error = self._last = ""
        self._reader = threading.Thread(target=self._pass_on, daemon=True)
        self._reader.start()

    def __str__(self) -> str:
        return f"{self.name} ({self.address})"

    def _pass_on(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # our stderr is gone: keep reading, or the child blocks on a full pipe
            if line.strip():
                self._last = line.strip()
                self._error = error_message(line) or self._error

    def read_out(self) -> None:
        """Once it has exited: until the rest of its output has gone on (bounded)."""
        self._reader.join(timeout=READ_S)

    def why(self) -> str:
        """Why it stopped, once it has: its exit status and its last error line (else its last
        line: a traceback's ends with the exception)."""
        self.read_out()
        said = self._error or self._last or "no output"
        return f"{self} exited with status {self.proc.returncode}: {said}"


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
    cluster = Cluster(args)
    try:
        failure = cluster.run(stop)
    finally:
        killed = stop_all(
            [[cluster.balancer] if cluster.balancer else [], cluster.servers],
            SERVING_STOP_S if cluster.serving else STARTING_STOP_S,
        )
    if killed and not failure:
        failure = "a process did not stop in time and was killed"
    if failure:
        print(f"sluice up: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


class Cluster:
    """The servers and the balancer of one `sluice up`, as they are started."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.servers: list[Child] = []
        self.balancer: Child | None = None
        self.serving = False  # all of them served: from then on they drain when stopped

    def run(self, stop: threading.Event) -> str:
        """Start everything and run until `stop` (""), or until one cannot start or exits: the
        line that says so."""
        args = self.args
        if args.port == 0:  # free ports, for tests and for running beside something else
            args.port, *ports = free_ports(args.host, args.servers + 1)
        else:
            ports = [args.port + i for i in range(1, args.servers + 1)]
        # Every port looked at before anything starts: a taken one is said at once, not after
        # the servers before it loaded their models.
        names = ["balancer", *(f"server-{i}" for i in range(1, args.servers + 1))]
        for name, port in zip(names, [args.port, *ports], strict=True):
            try:
                check_port_free(args.host, port)
            except SluiceError as exc:
                return f"{name} cannot start: {exc}"
        for i, port in enumerate(ports, 1):
            self.servers.append(
                Child(
                    f"server-{i}",
                    f"{args.host}:{port}",
                    [str(BIN / "sluice-server"), "--host", args.host]
                    + (["--model", args.model] if args.model else [])
                    + ["--port", str(port), "--node-id", f"server-{i}"]
                    + [a for arg in args.server_arg for a in arg.split()],
                )
            )
        for server in self.servers:
            if failure := started(server, self.servers, stop):
                return failure
        balancer = Child(
            "balancer",
            f"{args.host}:{args.port}",
            [str(BIN / "sluice-balancer"), "--host", args.host, "--port", str(args.port)]
            + [a for server in self.servers for a in ("--backend", server.address)]
            + [a for arg in args.balancer_arg for a in arg.split()],
        )
        self.balancer = balancer
        if failure := started(balancer, [balancer, *self.servers], stop):
            return failure
        self.serving = True
        print(
            f"sluice up: balancer on {balancer.address} -> servers on "
            + ", ".join(server.address for server in self.servers)
            + " (Ctrl-C stops them)",
            flush=True,
        )
        while not stop.wait(0.5):
            for child in [balancer, *self.servers]:
                if child.proc.poll() is not None:
                    return child.why()
        return ""


def started(child: Child, running: list[Child], stop: threading.Event) -> str:
    """Nothing ("") once `child` serves; else, as soon as one of `running` exits or a stop is
    asked, the line that says so."""

    def abandon() -> bool:
        return stop.is_set() or any(c.proc.poll() is not None for c in running)

    try:
        if wait_serving(child.address, START_S, abandon=abandon):
            return ""
    except RuntimeError as exc:
        return f"{child} did not start: {exc}"
    for exited in running:
        if exited.proc.poll() is not None:
            return exited.why()
    return f"stopped before {child} served"


def stop_all(waves: Sequence[Sequence[Child]], timeout: float) -> bool:
    """Wave by wave (the balancer, then the servers): SIGTERM all of the wave, wait, SIGKILL
    any still running after `timeout`. True when one had to be killed."""
    killed = False
    for wave in waves:
        for child in wave:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in wave:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
                killed = True
            child.read_out()
    return killed


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
