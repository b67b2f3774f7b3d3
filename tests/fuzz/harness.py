"""Running a fuzz target under libFuzzer (atheris): its flags from the command line, and a
corpus seeded with real messages so that mutation starts near valid bytes."""

from __future__ import annotations

import hashlib
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import atheris  # type: ignore[import-untyped]  # no stubs


def seed(folder: Path, bodies: Iterable[bytes]) -> None:
    """Write `bodies` into a corpus folder, named by content as libFuzzer names its own."""
    folder.mkdir(parents=True, exist_ok=True)
    for body in bodies:
        (folder / hashlib.sha1(body).hexdigest()).write_bytes(body)


def main(name: str, check: Callable[[bytes], None], seeds: Callable[[], Iterable[bytes]]) -> None:
    """Fuzz `check` with libFuzzer's arguments from sys.argv. With no corpus folder named,
    the seeds go to one folder of the system's temporary directory for this target (reused,
    so repeated runs do not leave a folder each)."""
    argv = list(sys.argv)
    folders = [Path(a) for a in argv[1:] if not a.startswith("-")]
    if not folders:
        folders = [Path(tempfile.gettempdir()) / f"sluice-fuzz-{name}"]
        argv.append(str(folders[0]))
    seed(folders[0], seeds())
    # A warning on the way (numpy's overflow, a deprecation) is a finding too.
    warnings.simplefilter("error")
    atheris.Setup(argv, check)
    atheris.Fuzz()
