"""A script beside a folder named `sluice` still imports the installed Sluice.

The folder above a clone named `sluice` holds such a folder (the clone itself). Python takes a
directory without `__init__.py` found on sys.path (the script's own directory comes first) as
a namespace package. A regular package anywhere on sys.path wins over it, but an import
hook that comes after the path search (setuptools' default editable install) does not:
`from sluice import SluiceClient` then fails with "cannot import name 'SluiceClient' from
'sluice' (unknown location)". scripts/bootstrap's editable install puts the checkout on
sys.path instead, where sluice/ is a regular package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """\
import sluice
from sluice import SluiceClient
print(sluice.__file__)
"""


def test_a_script_beside_a_folder_named_sluice_imports_the_package(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    (parent / "sluice").mkdir(parents=True)  # like a clone named sluice, seen from above it
    (parent / "use.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    done = subprocess.run(
        [sys.executable, "use.py"], cwd=parent, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == REPO / "sluice" / "__init__.py"
