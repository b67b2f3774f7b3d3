"""`sluice perf --quiet` hides the live table and the summary: without --out its results
would go nowhere, so the combination is refused before any call (nothing listens on
127.0.0.1:1), argparse's way, saying what to add."""

from __future__ import annotations

import pytest

from sluice.perf import sweep


def test_quiet_without_out_is_refused_before_any_call(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        sweep.main(["--target", "127.0.0.1:1", "-n", "1", "--quiet"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sluice perf")
    assert "sluice perf: error: --quiet prints no results" in err and "--out PATH" in err


def test_the_help_says_quiet_needs_out(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--quiet no live table or summary: the results go to --out only" in shown
