"""The hints sluice.client.diagnose adds: read off grpc's words for a size limit or an
untrusted certificate, a target probed at most once a while (the probe itself is
test_probe's), and naming only options that exist, in the reader's words (the client's
parameters for Python, the commands' flags and variables for the commands; the programs' flag
for both). The probes go to a listening socket on 127.0.0.1 made here, which never answers."""

from __future__ import annotations

import argparse
import inspect
import re
import socket
from collections.abc import Iterator

import grpc
import pytest

from sluice.client import SluiceClient, cli, connect, diagnose
from sluice.client.diagnose import Audience
from sluice.core import limits
from sluice.runtime import config
from sluice.runtime.probe import Port, Shown
from sluice.runtime.settings import ProgramSettings

TARGET = "127.0.0.1:9"
PYTHON, COMMANDS = Audience.PYTHON, Audience.COMMANDS
NEVER_CONNECTED = "failed to connect to all addresses; last error: UNAVAILABLE: Socket closed"
UNTRUSTED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: Ssl handshake "
    "failed: SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
    "CERTIFICATE_VERIFY_FAILED"
)
MISMATCHES = [
    (Shown(), Port.TLS),
    (Shown(), Port.TLS_CLOSED),
    (Shown(tls=True), Port.TLS_CLOSED),
    (Shown(tls=True), Port.PLAINTEXT),
]


def unavailable(details: str) -> grpc.RpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None
    )


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A port that takes connections and never answers: a probe of it ends at its bound."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.setblocking(False)
        yield sock


def connections(listener: socket.socket) -> int:
    """How many connections came since the last look (each probe's: a connection waits in
    the backlog, closed or not, until it is accepted)."""
    count = 0
    for _ in range(16):
        try:
            accepted, _ = listener.accept()
        except BlockingIOError:
            break
        accepted.close()
        count += 1
    return count


def address(listener: socket.socket) -> str:
    return f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize(
    ("details", "whose", "message"),
    [
        ("CLIENT: Sent message larger than max (2097180 vs. 1048576)", "client", "request"),
        ("CLIENT: Received message larger than max (300 vs. 64)", "client", "reply"),
        ("SERVER: Received message larger than max (2097180 vs. 1048576)", "peer", "request"),
        ("SERVER: Sent message larger than max (300 vs. 64)", "peer", "reply"),
    ],
)
def test_the_size_hint_names_whose_limit_and_keeps_the_sizes(
    details: str, whose: str, message: str
) -> None:
    for audience in Audience:
        hint = diagnose.size_hint(details, TARGET, audience)
        size, limit = re.findall(r"\d+", details)[-2:]
        assert hint.startswith(f"the {message} ({size} bytes)") and f"({limit})" in hint, hint
        assert (diagnose.CLIENT_LIMIT[audience] in hint) == (whose == "client")
        assert (limits.RAISE in hint) == (whose == "peer")
        assert (f"at {TARGET}" in hint) == (whose == "peer")


def test_no_size_hint_without_grpcs_words() -> None:
    assert diagnose.size_hint("overloaded: queue full", TARGET, PYTHON) == ""


def test_a_planner_relayed_refusal_gets_the_hint_too() -> None:
    relayed = (
        "no backend can take the call: every backend was tried; 127.0.0.1:1: the stream "
        "failed: RESOURCE_EXHAUSTED: SERVER: Received message larger than max (5 vs. 4)"
    )
    assert "--max-message-bytes" in diagnose.size_hint(relayed, TARGET, COMMANDS)


@pytest.mark.parametrize(
    ("shown", "port", "words"),
    [
        (Shown(), Port.TLS, "speaks TLS"),
        (Shown(), Port.TLS_CLOSED, "also requires a client certificate"),
        (Shown(tls=True), Port.TLS_CLOSED, "requires a client certificate (mutual TLS)"),
        (Shown(tls=True, certificate=True), Port.TLS_CLOSED, "does not take this one"),
        (Shown(tls=True), Port.PLAINTEXT, "speaks plaintext"),
    ],
)
def test_the_tls_hint_of_each_mismatch(shown: Shown, port: Port, words: str) -> None:
    for audience in Audience:
        assert words in diagnose.tls_hint(TARGET, shown, port, audience)


@pytest.mark.parametrize(
    ("shown", "port"),
    [(Shown(), Port.PLAINTEXT), (Shown(), Port.UNKNOWN), (Shown(tls=True), Port.TLS)],
)
def test_no_tls_hint_where_client_and_port_agree(shown: Shown, port: Port) -> None:
    assert diagnose.tls_hint(TARGET, shown, port, PYTHON) == ""


def hints() -> dict[str, list[str]]:
    """Every hint text of the module: by audience, and those both read ("both")."""
    found: dict[str, list[str]] = {"both": [], PYTHON.value: [], COMMANDS.value: []}
    for name, value in vars(diagnose).items():
        if name.isupper() and isinstance(value, str):
            found["both"].append(value)
        elif name.isupper() and isinstance(value, dict):
            for audience, text in value.items():
                found[audience.value].append(text)
    return found


def test_every_option_named_exists() -> None:
    words = " ".join(text for texts in hints().values() for text in texts)
    parser = argparse.ArgumentParser()
    connect.add_options(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    helps = " ".join(action.help or "" for action in parser._actions)
    for flag in set(re.findall(r"--[a-z-]+[a-z]", words)) - {"--max-message-bytes"}:
        assert flag in flags or flag == "--tls-client-ca", flag
    for env in set(re.findall(r"SLUICE_[A-Z_]+[A-Z]", words)) - {"SLUICE_MAX_MESSAGE_BYTES"}:
        assert f"env {env}" in helps, env
    assert "max_message_bytes" in ProgramSettings.__dataclass_fields__  # --max-message-bytes
    assert config.field_type(ProgramSettings.__dataclass_fields__["max_message_bytes"]) == "int"
    parameters = inspect.signature(SluiceClient).parameters
    for parameter in re.findall(r"\b([a-z_]+)=", words):
        assert parameter in parameters, parameter


def test_the_commands_take_the_client_limit_the_hint_names() -> None:
    """CLIENT_LIMIT's --max-message-bytes: each client command has it, read from the variable
    the server reads, so one export raises both."""
    assert "--max-message-bytes" in diagnose.CLIENT_LIMIT[COMMANDS]
    assert "SLUICE_MAX_MESSAGE_BYTES" in diagnose.CLIENT_LIMIT[COMMANDS]
    commands = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    for name in ("predict", "health", "metadata"):
        option = next(
            a for a in commands.choices[name]._actions if "--max-message-bytes" in a.option_strings
        )
        assert "env SLUICE_MAX_MESSAGE_BYTES" in (option.help or ""), name
        assert option.type is int


def test_each_reader_reads_its_own_options() -> None:
    """A command's user reads flags and variables, not keywords; Python's reads keywords, not
    the commands' variables (the server's flags are for both)."""
    texts = hints()
    assert texts[PYTHON.value] and len(texts[PYTHON.value]) == len(texts[COMMANDS.value])
    for text in texts[COMMANDS.value] + texts["both"]:
        assert not re.search(r"\b[a-z]+_[a-z_]+\b|\b[a-z_]+=", text), text
    for text in texts[PYTHON.value] + texts["both"]:
        assert "[env " not in text and "--tls-ca" not in text, text
    for shown, port in MISMATCHES:
        python = diagnose.tls_hint(TARGET, shown, port, PYTHON)
        commands = diagnose.tls_hint(TARGET, shown, port, COMMANDS)
        assert re.search(r"\b(tls|server_name)(_[a-z]+)?[=,)]", python), python
        assert "--tls" in commands and "tls_" not in commands, commands


def test_the_commands_connection_explains_in_flags() -> None:
    error = unavailable(UNTRUSTED)
    details = connect.Connection(tls_ca="ca.pem").explained(error, TARGET).details() or ""
    assert details.startswith("this command does not trust") and "--tls-ca" in details, details
    assert "tls_ca=" not in details
    assert connect.Connection().client_kwargs()["hints"] is COMMANDS


def test_an_untrusted_certificate_is_read_off_grpcs_words(listener: socket.socket) -> None:
    # grpc names the cause itself: the target is not probed for it.
    target, error = address(listener), unavailable(UNTRUSTED)
    details = diagnose.explained(error, target, Shown(tls=True), PYTHON).details() or ""
    assert details.startswith(f"this client does not trust {target}'s certificate"), details
    assert not diagnose.needs_probe(error, target, Shown(tls=True))
    assert connections(listener) == 0


def test_a_targets_probe_is_kept_a_while(listener: socket.socket) -> None:
    now = [0.0]
    probes = diagnose.Probes(bound_s=0.2, clock=lambda: now[0])
    target, error = address(listener), unavailable(NEVER_CONNECTED)
    assert diagnose.needs_probe(error, target, Shown(), probes)
    for _ in range(3):  # a retry loop: one probe, not one per failed call
        assert diagnose.explained(error, target, Shown(), PYTHON, probes) is error
    assert connections(listener) == 1
    assert not diagnose.needs_probe(error, target, Shown(), probes)
    now[0] += diagnose.KEEP_S
    assert diagnose.needs_probe(error, target, Shown(), probes)
    diagnose.explained(error, target, Shown(), PYTHON, probes)
    assert connections(listener) == 1  # kept no longer: probed again


def test_only_a_connection_that_never_formed_is_probed(listener: socket.socket) -> None:
    target = address(listener)
    for error in (unavailable("overloaded"), unavailable(NEVER_CONNECTED)):
        for shown, at in ((None, target), (Shown(), "")):
            assert not diagnose.needs_probe(error, at, shown)
            assert diagnose.explained(error, at, shown, PYTHON) is error
    assert connections(listener) == 0
