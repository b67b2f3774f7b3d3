"""What `sluice` says at the edges a new user meets before any call: a TLS file that is not
there names its option and the file, a target without a port is refused (the forms grpc
resolves by a scheme keep working), and a closed stdout (`sluice ... | head`) ends the
command quietly with the status a pipe's writer killed by SIGPIPE has."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from perf.certs import Authority, Pair
from sluice.client import cli, connect


@pytest.fixture
def client_cert(tmp_path: Path) -> Pair:
    return Authority(tmp_path).issue("client")


@pytest.mark.parametrize("option", ["--tls-ca", "--tls-cert", "--tls-key"])
def test_a_missing_tls_file_names_its_option_and_the_file(
    option: str, client_cert: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nope.pem")
    given = {
        "--tls-ca": str(client_cert.cert),
        "--tls-cert": str(client_cert.cert),
        "--tls-key": str(client_cert.key),
    }
    given[option] = missing
    argv = [arg for flag, path in given.items() for arg in (flag, path)]
    # Port 1: nothing listens there, and the file is named before any connection is tried.
    assert cli.main(["health", "--target", "127.0.0.1:1", *argv]) == 2
    assert capsys.readouterr().err == f"sluice: {option} {missing}: no such file\n"


def test_a_tls_file_that_is_not_pem_names_its_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    assert cli.main(["health", "--target", "127.0.0.1:1", "--tls-ca", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"sluice: --tls-ca {bad}: ")


@pytest.mark.parametrize(
    "target",
    ["127.0.0.1:8000", "localhost:1", "[::1]:8000", "dns:///localhost:8000", "dns:localhost:1"],
)
def test_targets_with_a_port(target: str) -> None:
    assert connect.has_port(target)


@pytest.mark.parametrize(
    "target",
    # Resolved by their scheme, which needs no port or checks its own.
    ["unix:/tmp/s.sock", "unix:///tmp/s.sock", "unix-abstract:s", "ipv4:127.0.0.1:1", "vsock:3:1"],
)
def test_targets_grpc_resolves_by_their_scheme(target: str) -> None:
    assert connect.has_port(target)


@pytest.mark.parametrize(
    "target", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.1:", "dns:///localhost"]
)
def test_targets_without_a_port(target: str) -> None:
    assert not connect.has_port(target)


@pytest.mark.parametrize("command", ["health", "top", "perf"])
def test_a_target_without_a_port_is_refused(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # grpc would dial port 443 in silence.
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--target", "127.0.0.1"])
    assert exited.value.code == 2
    assert "argument --target: 127.0.0.1 has no port: give HOST:PORT" in capsys.readouterr().err


def test_the_environments_target_is_checked_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLUICE_TARGET", "localhost")
    with pytest.raises(SystemExit):
        cli.main(["health"])
    said = capsys.readouterr().err
    assert "argument --target: SLUICE_TARGET='localhost'" in said
    assert "localhost has no port: give HOST:PORT" in said


@contextmanager
def closed_stdout() -> Iterator[None]:
    """sys.stdout as a pipe whose reader is gone, as `| head` leaves it once it has read its
    lines. Set in the test itself: capsys takes sys.stdout over again as the test starts."""
    read, write = os.pipe()
    os.close(read)
    shown = sys.stdout
    with open(write, "w") as pipe:
        sys.stdout = pipe
        try:
            yield
        finally:
            sys.stdout = shown


def test_a_closed_stdout_ends_the_command_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    with closed_stdout():
        status = cli.main(["key", "someone"])
    assert status == 141  # 128 + SIGPIPE, as a shell's pipeline shows a writer it killed
    assert capsys.readouterr().err == ""
