"""Flags, then SLUICE_ environment variables, then defaults."""

from __future__ import annotations

import argparse
import os

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


def test_model_entries_and_repository_flags() -> None:
    settings = parse(["--model", "a=/m/a.onnx", "--model", "/m/b.onnx"])
    assert settings.models() == [("a", "/m/a.onnx"), ("", "/m/b.onnx")]
    assert parse([], {"SLUICE_MODEL": "a=/x.onnx,b=/y.onnx"}).models() == [
        ("a", "/x.onnx"),
        ("b", "/y.onnx"),
    ]
    assert parse([]).models()[0][1].endswith("digits.onnx")  # the bundled model by default
    served = parse(["--model-repository", "/r", "--repository-api"])
    assert served.model == [] and served.repository_api  # a bare boolean flag turns it on
    assert not parse(["--model-repository", "/r", "--repository-api", "false"]).repository_api
    with pytest.raises(ValueError, match="--repository-api needs --model-repository"):
        parse(["--repository-api"])
    with pytest.raises(ValueError, match="NAME=PATH, not '=x'"):
        parse(["--model", "=x"])
    with pytest.raises(ValueError, match="two --model entries have one name"):
        parse(["--model", "a=/x", "--model", "a=/y"])


def test_workers_auto_is_one_per_core_on_the_cpu_and_one_on_a_gpu() -> None:
    auto = parse(["--workers", "auto"])
    assert auto.worker_count(gpu=False) == (os.cpu_count() or 1)
    assert auto.worker_count(gpu=True) == 1
    assert parse(["--workers", "3"]).worker_count(gpu=True) == 3
    with pytest.raises(ValueError, match="--workers must be a number of processes or auto"):
        parse(["--workers", "many"])


def test_cuda_options_and_pinned_staging() -> None:
    settings = parse(["--cuda-options", "prefer_nhwc=1, cudnn_conv_algo_search=HEURISTIC"])
    assert settings.provider_options() == {
        "prefer_nhwc": "1",
        "cudnn_conv_algo_search": "HEURISTIC",
    }
    assert parse([]).provider_options() == {}
    assert parse([]).pinned_staging
    assert not parse([], {"SLUICE_PINNED_STAGING": "false"}).pinned_staging
    with pytest.raises(ValueError, match="--cuda-options takes KEY=VALUE"):
        parse(["--cuda-options", "prefer_nhwc"])


def test_an_option_without_a_settings_class_follows_the_same_rule() -> None:
    def parse_timeout(argv: list[str], env: dict[str, str]) -> float:
        parser = argparse.ArgumentParser()
        config.add_option(parser, "timeout", "10", "seconds per call", environ=env, type=float)
        assert "seconds per call [env SLUICE_TIMEOUT; 10]" in " ".join(parser.format_help().split())
        timeout: float = parser.parse_args(argv).timeout
        return timeout

    assert parse_timeout([], {}) == 10.0
    assert parse_timeout([], {"SLUICE_TIMEOUT": "2.5"}) == 2.5
    assert parse_timeout([], {"SLUICE_TIMEOUT": ""}) == 10.0  # set but empty: not given
    assert parse_timeout(["--timeout", "1"], {"SLUICE_TIMEOUT": "2.5"}) == 1.0


def test_the_client_commands_take_target_and_timeout_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sluice.client import cli, top

    monkeypatch.setenv("SLUICE_TARGET", "h:1")
    monkeypatch.setenv("SLUICE_TIMEOUT", "3")
    args = cli.build_parser().parse_args(["health"])
    assert (args.target, args.timeout) == ("h:1", 3.0)
    assert top.build_parser().parse_args([]).target == "h:1"
    monkeypatch.delenv("SLUICE_TARGET")
    assert top.build_parser().parse_args([]).target == "127.0.0.1:8000"
    assert "[env SLUICE_TARGET; 127.0.0.1:8000]" in " ".join(
        top.build_parser().format_help().split()
    )


@pytest.mark.parametrize(
    ("env", "raw", "said"),
    [
        ("SLUICE_MAX_BATCH", "abc", "(read as --max-batch was not given): expected an integer"),
        ("SLUICE_GRACE_S", "soon", "(read as --grace-s was not given): expected a number"),
        ("SLUICE_PINNED_STAGING", "maybe", "(read as --pinned-staging was not given): "),
    ],
)
def test_a_variable_that_does_not_parse_names_itself_the_flag_and_the_type(
    env: str, raw: str, said: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse([], {env: raw})
    assert str(exited.value.code).startswith(f"{env}={raw!r} {said}")
    assert "invalid literal" not in str(exited.value.code)


def test_an_options_variable_that_does_not_parse_names_itself_and_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sluice.client import cli

    monkeypatch.setenv("SLUICE_TIMEOUT", "abc")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["health"])
    said = capsys.readouterr().err
    assert "argument --timeout: SLUICE_TIMEOUT='abc' (read as --timeout was not given): " in said
    assert "expected a number" in said
    monkeypatch.delenv("SLUICE_TIMEOUT")
    with pytest.raises(SystemExit):  # the flag's own value: argparse names the flag and type
        cli.build_parser().parse_args(["health", "--timeout", "abc"])
    assert "argument --timeout: invalid float value: 'abc'" in capsys.readouterr().err
