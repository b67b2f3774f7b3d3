"""Flags, then SLUICE_ environment variables, then defaults."""

from __future__ import annotations

import pytest

from sluice.runtime import config
from sluice.server.settings import ServerSettings


def parse(argv: list[str], env: dict[str, str] | None = None) -> ServerSettings:
    return config.parse(ServerSettings, argv, "sluice-server", "", environ=env or {})


def test_defaults() -> None:
    settings = parse([])
    assert settings.port == 8001 and settings.device == "auto"
    assert settings.node_id  # the hostname when not given


def test_environment_fills_what_flags_leave() -> None:
    settings = parse(["--port", "9000"], {"SLUICE_PORT": "9100", "SLUICE_NODE_ID": "env-node"})
    assert settings.port == 9000
    assert settings.node_id == "env-node"


def test_every_field_has_a_flag_and_a_variable() -> None:
    help_text = config.build_parser(ServerSettings, "sluice-server", "").format_help()
    for name in ServerSettings.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in help_text
        assert "SLUICE_" + name.upper() in help_text


def test_bad_values_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="--device must be one of"):
        parse(["--device", "tpu"])
    with pytest.raises(SystemExit, match="SLUICE_GRACE_S='soon'"):
        parse([], {"SLUICE_GRACE_S": "soon"})


def test_drain_delay_from_a_flag_or_the_environment_and_never_negative() -> None:
    assert parse([]).drain_delay_s == 0.0  # off unless asked for
    assert parse(["--drain-delay-s", "2.5"]).drain_delay_s == 2.5
    assert parse([], {"SLUICE_DRAIN_DELAY_S": "1"}).drain_delay_s == 1.0
    with pytest.raises(ValueError, match="--drain-delay-s must not be negative"):
        parse(["--drain-delay-s", "-1"])
