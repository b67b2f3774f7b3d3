"""`sluice predict`'s options, read before any call: JSON inputs are NAME=JSON, JSON output is
--json-output (the old --json, which read as "the input is JSON", is refused with both
names), and every argument error names the input and says what was expected, argparse's way
(usage, `sluice predict: error: ...`, exit status 2). Nothing listens on 127.0.0.1:1: these
errors come before any call, and a call that fails there says what it was for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sluice.client import cli

TARGET = ("--target", "127.0.0.1:1")


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stderr of `sluice ARGV`, which must stop as argparse does on a usage error."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(list(argv))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sluice "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("command", ["predict", "health", "metadata"])
def test_the_old_json_flag_is_refused_with_the_new_names(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    inputs = ["input=[[1]]"] if command == "predict" else []
    err = refused(capsys, command, *TARGET, "--json", *inputs)
    assert f"sluice {command}: error: --json is now --json-output" in err


def test_the_json_input_hint_comes_with_predict(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "predict", *TARGET, "--json", "input=[[1]]")
    assert "NAME=JSON" in err


@pytest.mark.parametrize(
    ("argument", "said"),
    [
        ("input=[[1, 2", "input 'input': its value is not JSON"),
        ("input=[[1, 2]]]", "input 'input': its value is not JSON"),
        ("input=", "input 'input': its value is not JSON"),
        ("input=x.np", "input 'input': its value is not JSON"),
        ("=[[1]]", "'=[[1]]' is not NAME=VALUE"),
        ("[[1]]", "'[[1]]' is not NAME=VALUE"),
    ],
)
def test_an_input_that_does_not_read_is_named(
    capsys: pytest.CaptureFixture[str], argument: str, said: str
) -> None:
    err = refused(capsys, "predict", *TARGET, argument)
    assert f"sluice predict: error: {said}" in err
    assert "NAME=FILE.npy, NAME=FILE.json or NAME=JSON" in err


def test_a_missing_file_is_named_with_its_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for suffix in (".json", ".npy"):
        path = tmp_path / f"absent{suffix}"
        err = refused(capsys, "predict", *TARGET, f"pixels={path}")
        assert f"input 'pixels': cannot read {path}" in err


def test_files_that_are_not_what_they_say_are_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("[[1, 2")
    err = refused(capsys, "predict", *TARGET, f"pixels={bad_json}")
    assert f"input 'pixels': {bad_json} is not JSON" in err
    bad_npy = tmp_path / "bad.npy"
    bad_npy.write_text("not numpy")
    err = refused(capsys, "predict", *TARGET, f"pixels={bad_npy}")
    assert f"input 'pixels': cannot read {bad_npy} as a .npy file" in err


def test_an_input_given_twice_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "predict", *TARGET, "x=[1]", "x=[2]")
    assert "input 'x' is given twice" in err


def test_no_inputs_says_what_is_expected(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "predict", *TARGET)
    assert "predict needs inputs" in err and "--sample DIGIT" in err


def test_predict_help_shows_the_distinct_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["predict", "--help"])
    assert stopped.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--json-output" in shown
    assert "NAME=JSON" in shown and "converted to the input's datatype" in shown
    assert "--json " not in shown and "--json," not in shown  # the refused name is not offered


def test_a_failed_metadata_call_says_what_it_was_for(capsys: pytest.CaptureFixture[str]) -> None:
    """NAME=JSON needs the model's datatypes: when asking fails, the error names that step,
    not a method the user never called."""
    assert cli.main(["predict", *TARGET, "input=[[1.0]]"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "sluice predict: could not ask the model's metadata (needed for the inputs' "
        "datatypes): UNAVAILABLE: "
    ), err
    assert "Traceback" not in err


def test_an_array_input_asks_no_metadata(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A .npy input carries its datatype: the one call made is the Predict."""
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((1, 64), np.float32))
    assert cli.main(["predict", *TARGET, f"input={path}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sluice predict: UNAVAILABLE: "), err
    assert "metadata" not in err.lower()
