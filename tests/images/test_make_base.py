"""scripts/make-base's choice of mirror, on apt folders made here: any Debian archive source
whatever suite it names (one naming bookworm first), never -security or another vendor's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.images.engine import REPO

pytestmark = pytest.mark.images

SCRIPT = (REPO / "scripts" / "make-base").read_text()
# The script's own function, run alone: from its line to the first closing brace.
FUNCTION = SCRIPT[SCRIPT.index("apt_mirrors() {") : SCRIPT.index("\n}\n") + 3]


def mirrors(apt: Path) -> list[str]:
    done = subprocess.run(
        ["bash", "-c", f'set -euo pipefail\n{FUNCTION}apt_mirrors "$0"', str(apt)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.split()


def apt_folder(tmp_path: Path, sources: str = "", listed: str = "") -> Path:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(sources)
    (tmp_path / "sources.list").write_text(listed)
    return tmp_path


def test_any_debian_archive_is_taken_and_bookworm_first(tmp_path: Path) -> None:
    sources = """Types: deb
URIs: http://mirror.example/debian/
Suites: trixie trixie-updates
Components: main

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: trixie-security
Components: main

Types: deb
URIs: https://deb.nodesource.com/node_20.x
Suites: nodistro
Components: main

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://off.example/debian
Suites: bookworm
Enabled: no
"""
    listed = """deb [signed-by=/k.gpg] http://bookworm.example/debian bookworm main
deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main
"""
    found = mirrors(apt_folder(tmp_path, sources, listed))
    assert found == ["http://bookworm.example/debian", "http://mirror.example/debian/"]


def test_no_debian_archive_finds_none(tmp_path: Path) -> None:
    listed = "deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n"
    assert mirrors(apt_folder(tmp_path, listed=listed)) == []
