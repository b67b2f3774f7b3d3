"""The hints sluice.client.diagnose adds: read off grpc's words for a size limit, and
naming only options that exist (the client's parameters, the commands' flags and
variables, the programs' flag)."""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from sluice.client import SluiceClient, cli, connect, diagnose
from sluice.client.diagnose import Port, Shown
from sluice.runtime import config
from sluice.runtime.settings import ProgramSettings

TARGET = "127.0.0.1:9"


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
    hint = diagnose.size_hint(details, TARGET)
    size, limit = re.findall(r"\d+", details)[-2:]
    assert hint.startswith(f"the {message} ({size} bytes)") and f"({limit})" in hint, hint
    assert (diagnose.CLIENT_LIMIT in hint) == (whose == "client")
    assert (diagnose.PEER_LIMIT in hint) == (whose == "peer")
    assert (f"at {TARGET}" in hint) == (whose == "peer")


def test_no_size_hint_without_grpcs_words() -> None:
    assert diagnose.size_hint("overloaded: queue full", TARGET) == ""


def test_a_planner_relayed_refusal_gets_the_hint_too() -> None:
    relayed = (
        "no backend can take the call: every backend was tried; 127.0.0.1:1: the stream "
        "failed: RESOURCE_EXHAUSTED: SERVER: Received message larger than max (5 vs. 4)"
    )
    assert "--max-message-bytes" in diagnose.size_hint(relayed, TARGET)


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
    assert words in diagnose.tls_hint("Socket closed", TARGET, shown, port)


@pytest.mark.parametrize(
    ("shown", "port"),
    [(Shown(), Port.PLAINTEXT), (Shown(), Port.UNKNOWN), (Shown(tls=True), Port.TLS)],
)
def test_no_tls_hint_where_client_and_port_agree(shown: Shown, port: Port) -> None:
    assert diagnose.tls_hint("Socket closed", TARGET, shown, port) == ""


@pytest.mark.parametrize(
    ("target", "address"),
    [
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("localhost:1", ("localhost", 1)),
        ("[::1]:8000", ("::1", 8000)),
        ("dns:///example.org:443", ("example.org", 443)),
        ("ipv4:10.0.0.1:80", ("10.0.0.1", 80)),
        ("unix:/tmp/sock", None),
        ("ipv4:10.0.0.1:80,10.0.0.2:80", None),
        ("example.org", None),
    ],
)
def test_host_port(target: str, address: tuple[str, int] | None) -> None:
    assert diagnose.host_port(target) == address


def test_a_port_nothing_listens_on_is_unknown() -> None:
    assert diagnose.probe("127.0.0.1:9", bound_s=0.5) in (Port.UNKNOWN,)


def test_every_option_named_exists() -> None:
    words = " ".join(
        value for name, value in vars(diagnose).items() if name.isupper() and isinstance(value, str)
    )
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
    assert "--max-message-bytes" in diagnose.CLIENT_LIMIT
    assert "SLUICE_MAX_MESSAGE_BYTES" in diagnose.CLIENT_LIMIT
    commands = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    for name in ("predict", "health", "metadata"):
        option = next(
            a for a in commands.choices[name]._actions if "--max-message-bytes" in a.option_strings
        )
        assert "env SLUICE_MAX_MESSAGE_BYTES" in (option.help or ""), name
        assert option.type is int
