"""A script beside a folder named `sluice` still imports the installed Sluice.

The folder above a clone named `sluice` holds such a folder (the clone itself). Python takes a
directory without `__init__.py` found on sys.path (the script's own directory comes first) as
a namespace package. A regular package anywhere on sys.path wins over it, but an import
hook that comes after the path search (setuptools' default editable install) does not:
`from sluice import SluiceClient` then fails with "cannot import name 'SluiceClient' from
'sluice' (unknown location)". scripts/bootstrap puts a path entry on sys.path that holds the
checkout's sluice/ alone, a regular package there; nothing else of the checkout (server/,
client/, tests/, perf/) becomes importable, where a user's own packages of those names
would lose to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
SCRIPT = """\
import sluice
from sluice import SluiceClient
print(sluice.__file__)
"""


def test_a_script_beside_a_folder_named_sluice_imports_the_package(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    (parent / "sluice").mkdir(parents=True)  # like a clone named sluice, seen from above it
    (parent / "use.py").write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "use.py"], cwd=parent, env=ENV, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == REPO / "sluice" / "__init__.py"


@pytest.mark.parametrize("name", ["server", "balancer", "client", "perf", "tests", "protos"])
def test_no_other_folder_of_the_checkout_is_importable(name: str, tmp_path: Path) -> None:
    done = python(f"import {name}; print({name}.__file__ or {name}.__path__)", tmp_path)
    assert done.returncode != 0, f"{name} imported from {done.stdout}"
    assert f"No module named {name!r}" in done.stderr, done.stderr


def test_sluice_is_the_checkouts_from_anywhere(tmp_path: Path) -> None:
    done = python("import sluice.server.main; print(sluice.__file__)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == REPO / "sluice" / "__init__.py"


def python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """This venv's Python running `code` in `cwd`, as a user's script elsewhere would."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


# Every module of the product imported, then each one's file: its real path (not a link's),
# and no file loaded as two modules. (sluice/__init__.py itself is found through the path entry,
# so outside the checkout through its link.)
ONE_PATH = """\
import importlib, os, pkgutil, sys
import sluice
for found in pkgutil.walk_packages(sluice.__path__, "sluice."):
    importlib.import_module(found.name)
files = {}
for name, module in sorted(sys.modules.items()):
    file = getattr(module, "__file__", None)
    if name.startswith("sluice.") and file:
        assert file == os.path.realpath(file), (name, file)
        assert file not in files, (name, files.get(file))
        files[file] = name
print(len(files))
"""


@pytest.mark.parametrize("where", ["elsewhere", "checkout"])
def test_each_module_has_one_file_path(where: str, tmp_path: Path) -> None:
    done = python(ONE_PATH, tmp_path if where == "elsewhere" else REPO)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 100  # every module of the product, not a few


@pytest.mark.parametrize("name", ["server", "balancer", "client"])
def test_a_program_folder_has_one_import_path(name: str) -> None:
    done = python(f"import {name}", REPO)  # the checkout on sys.path, as in its scripts
    assert done.returncode != 0
    assert f"the checkout's {name}/ is the package sluice.{name}: import that" in done.stderr
