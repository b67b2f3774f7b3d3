"""grpc-core's own log lines (absl's `I1201 12:11:29.876655 28661 file.cc:123] ...`, in its
format whatever --log-format says) stay off in every Sluice program however it is started:
the installed command, what that command runs (sluice.entry), and `python -m` (as workers
and the benchmarks start them). Failed handshakes at a mutual-TLS port (plaintext, TLS
without a client certificate) and a port already taken leave only the program's own lines on
stderr, in the --log-format asked for; GRPC_VERBOSITY set by the user brings grpc-core's
back. A port that cannot be had is said in our words, with its likely cause."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import pytest

from perf.certs import Authority, Pair
from perf.tls import mutual
from sluice.client import SluiceClient
from sluice.runtime.launch import BIN
from tests.e2e.harness import Process, server_argv, wait_for

pytestmark = pytest.mark.e2e

# A grpc-core line, absl's: level letter, date, time, thread, file:line]; e.g.
# `E1201 12:21:15.365114   13473 add_port.cc:83] Failed to add port to server: ...`.
CORE_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] ", re.MULTILINE)
# The child decides for itself: an inherited GRPC_VERBOSITY would hide what it does.
UNSET = {"GRPC_VERBOSITY": ""}
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = bytes.fromhex("000000040000000000")  # an empty HTTP/2 SETTINGS frame
ENTRY = {"sluice-server": "server", "sluice-balancer": "balancer"}
MODULE = {"sluice-server": "sluice.server.main", "sluice-balancer": "sluice.balancer.main"}
FORMS = ("installed", "entry", "module")


def command(program: str, form: str) -> list[str]:
    """How `program` starts: its installed command, the code that command runs, or -m."""
    if form == "installed":
        return [str(BIN / program)]
    if form == "entry":
        code = (
            f"import sys; from sluice.entry import {ENTRY[program]}; sys.exit({ENTRY[program]}())"
        )
        return [sys.executable, "-c", code]
    return [sys.executable, "-m", MODULE[program]]


def arguments(program: str, *listener: str) -> list[str]:
    """A program's flags on 127.0.0.1, port 0 unless `listener` says; a balancer's backend
    need not exist (it listens all the same)."""
    if program == "sluice-server":
        return [*server_argv()[1:], *listener]
    return ["--port", "0", "--backend", "127.0.0.1:9", *listener]


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def quiet_cert(ca: Authority) -> Pair:
    return ca.issue("quiet")


@pytest.fixture(scope="module")
def client(ca: Authority) -> Pair:
    return ca.issue("client")


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process (this one) listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield holder.getsockname()[1]


def plaintext_at(address: str) -> None:
    """An HTTP/2 preface in the clear at a TLS port, read until the server closes: by then
    its handshake has failed (and grpc-core, when loud, has written its line)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(HTTP2_PREFACE)
        for _ in range(100):  # bounded: a closed connection reads b"" (or is reset)
            try:
                if not conn.recv(4096):
                    break
            except (ConnectionResetError, TimeoutError):
                break


def tls_flags(quiet_cert: Pair) -> list[str]:
    return ["--tls-cert", str(quiet_cert.cert), "--tls-key", str(quiet_cert.key)]


def taken(
    program: str, form: str, port: int, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The program started on a port already held: it exits at once."""
    return subprocess.run(
        [*command(program, form), *arguments(program, "--port", str(port))],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def core_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if CORE_LINE.match(line)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("program", ["sluice-server", "sluice-balancer"])
def test_failed_handshakes_leave_only_the_programs_json_lines(
    ca: Authority, quiet_cert: Pair, client: Pair, program: str, form: str
) -> None:
    """A mutual-TLS program logging JSON answers a call with a client certificate (so what
    follows fails in the handshake, not in the setup), then is sent a plaintext preface and a
    TLS handshake without a certificate: every line on its stderr is one of its JSON lines."""
    listener = [*mutual(ca, quiet_cert), "--log-format", "json"]
    proc = Process([*command(program, form), *arguments(program, *listener)], env=UNSET)
    try:
        shown = {"tls_cert": str(client.cert), "tls_key": str(client.key)}
        with SluiceClient(proc.address, tls_ca=str(ca.cert), **shown) as ok:
            ok.health(timeout=30)
        plaintext_at(proc.address)
        with (
            SluiceClient(proc.address, tls_ca=str(ca.cert)) as without,
            pytest.raises(grpc.RpcError) as refused,
        ):
            without.health(timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    finally:
        code = proc.terminate()
    log = proc.log()
    assert code == 0, log
    assert "stopped after" in log  # its last line is in: nothing can come after
    assert not core_lines(log), log
    for line in filter(str.strip, log.splitlines()):
        json.loads(line)  # --log-format json: every line is the program's own


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("program", ["sluice-server", "sluice-balancer"])
def test_a_taken_port_is_said_in_our_words_alone(program: str, form: str, held_port: int) -> None:
    done = taken(program, form, held_port, UNSET)
    assert done.returncode == 1, done.stderr
    assert not core_lines(done.stderr), done.stderr
    said = [line for line in done.stderr.splitlines() if "cannot listen" in line]
    assert len(said) == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{held_port}: the port is in use" in said[0], said
    assert "GRPC_VERBOSITY" not in said[0] and "Failed to bind" not in said[0], said


@pytest.mark.parametrize("program", ["sluice-server", "sluice-balancer"])
def test_grpc_verbosity_given_brings_grpc_cores_lines_back(quiet_cert: Pair, program: str) -> None:
    # A failed handshake: a taken port is found by the program's own look before grpc binds,
    # so grpc-core never has a line to say about it.
    loud = Process(
        [*command(program, "module"), *arguments(program, *tls_flags(quiet_cert))],
        env={"GRPC_VERBOSITY": "INFO"},
    )
    try:
        plaintext_at(loud.address)
        wait_for(lambda: "Handshake failed" in loud.log(), "grpc-core's handshake line")
    finally:
        loud.kill()


@pytest.fixture
def not_tls() -> Iterator[str]:
    """A port that answers a TLS handshake with bytes that are not TLS (an HTTP/2 SETTINGS
    frame), as a plaintext server does."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.1)
        stop = threading.Event()

        def answer() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:  # the 0.1 s timeout: look at `stop` again
                    continue
                with conn, contextlib.suppress(OSError):
                    conn.sendall(SETTINGS)

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{listener.getsockname()[1]}"
        finally:
            stop.set()
            thread.join(timeout=10)


@pytest.mark.parametrize(
    ("form", "loud"), [("installed", False), ("entry", False), ("installed", True)]
)
def test_the_cli_is_quiet_unless_told(
    quiet_cert: Pair, not_tls: str, form: str, loud: bool
) -> None:
    """`sluice` (up, top and perf are its subcommands): its TLS handshake with a plaintext
    port fails, and its stderr holds its own error alone; GRPC_VERBOSITY=INFO shows grpc-core's
    line too."""
    if form == "installed":
        argv = [str(BIN / "sluice")]
    else:
        argv = [sys.executable, "-c", "import sys; from sluice.entry import cli; sys.exit(cli())"]
    done = subprocess.run(
        [*argv, "health", "--target", not_tls, "--tls-ca", str(quiet_cert.cert), "--timeout", "5"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GRPC_VERBOSITY": "INFO" if loud else ""},
    )
    assert done.returncode == 1, done.stderr
    assert "speaks plaintext" in done.stderr, done.stderr
    assert bool(core_lines(done.stderr)) == loud, done.stderr


@pytest.mark.parametrize("module", ["sluice.entry", "sluice.server", "sluice.balancer"])
def test_what_loads_before_the_quieting_imports_no_grpc(module: str) -> None:
    """sluice.entry, and the packages `python -m sluice.server.main` (or the balancer's) loads
    before its first line runs, must not import grpc: it would read GRPC_VERBOSITY too soon."""
    code = f"import sys, {module}; sys.exit('grpc' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"importing {module} loads grpc: {done.stderr}"
