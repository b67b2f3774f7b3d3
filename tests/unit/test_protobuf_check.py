"""`import sluice` says what is wrong when the protobuf it would run on is older than the
generated code needs (tritonclient[grpc], installed into the same environment, downgrades it
to protobuf<7), before any generated module is imported, and the version it asks for is the
one the project declares and the generated code was made with."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import sluice

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def old_protobuf(tmp_path: Path) -> dict[str, str]:
    """An environment whose first `google.protobuf` on the path is an older release: the
    package as protobuf 6 ships it starts with its version, and nothing else is needed to
    find out whether the check looks before anything else of protobuf is imported."""
    package = tmp_path / "google" / "protobuf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '6.33.6'\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


@pytest.mark.parametrize("module", ["sluice", "sluice.client", "sluice.server.main"])
def test_an_old_protobuf_is_named_at_import(module: str, old_protobuf: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        env=old_protobuf,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: sluice needs protobuf>=7.35.1"), done.stderr
    assert "protobuf 6.33.6" in last
    assert "tritonclient" in last  # the likely cause
    assert "pip install 'protobuf>=7.35.1'" in last  # the fix
    assert "environment of its own" in last


def test_the_protobuf_in_use_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sluice.client"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_the_version_asked_for_is_the_declared_and_generated_one() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"protobuf>={sluice.NEEDS_PROTOBUF}" in declared
    for generated in sorted((ROOT / "protos").rglob("*_pb2.py")):
        found = re.search(
            r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),",
            generated.read_text(),
        )
        assert found is not None, generated
        assert ".".join(found.groups()) == sluice.NEEDS_PROTOBUF, generated
