"""A registered region and the object under it: its name and key checked, the object opened
only if it is shared memory (a regular file on the root's tmpfs), its fd kept."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from sluice.core.errors import InvalidInput

SHM_ROOT = Path("/dev/shm")  # where POSIX shm objects live on Linux; Regions(root=...) for tests
MAX_NAME = 256
_KEY = re.compile(r"/[A-Za-z0-9._-]{1,250}")
_KEY_RULE = "'/' then 1-250 of A-Z a-z 0-9 . _ - (not '/.' or '/..', no other '/')"
_MOUNTS = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class RegionInfo:
    """A registered region, as Status reports it."""

    name: str
    key: str
    offset: int
    byte_size: int


class Region:
    """A registered region: its object's fd (kept, to check its size and links, and in copy
    mode to read and write it), the mapping from the page at or below its offset (None in
    copy mode), and the leases using it."""

    __slots__ = ("fd", "gone", "holders", "info", "inode", "map", "start")

    def __init__(self, info: RegionInfo, fd: int, mapped: mmap.mmap | None, start: int) -> None:
        self.info = info
        self.fd = fd
        st = os.fstat(fd)
        self.inode = st.st_dev, st.st_ino  # the object, whatever name reached it
        self.map: mmap.mmap | None = mapped
        self.start = start  # where the region begins in the mapping
        self.holders = 0  # leases that used it and are not released
        self.gone = False  # unregistered: closed when the last holder releases

    def close(self) -> None:
        mapped, self.map = self.map, None
        if mapped is not None:
            # Views of it may outlive the call (a caller's array): it goes with the last.
            with contextlib.suppress(BufferError):
                mapped.close()
        os.close(self.fd)


def quoted(text: str) -> str:
    """`text` quoted as Triton quotes names; escaped and cut short when a caller sent junk."""
    if len(text) <= MAX_NAME and text.isprintable():
        return f"'{text}'"
    return repr(text[:64]) + ("..." if len(text) > 64 else "")


def tmpfs_devices() -> set[int]:
    """The st_dev of each tmpfs mounted here (mountinfo's third field is its major:minor)."""
    devices: set[int] = set()
    try:
        text = _MOUNTS.read_text()
    except OSError:
        return devices
    for line in text.splitlines():
        fields, _, tail = line.partition(" - ")  # mountinfo escapes spaces within a field
        parts = fields.split()
        if len(parts) > 2 and tail.split()[:1] == ["tmpfs"]:
            major, _, minor = parts[2].partition(":")
            if major.isdigit() and minor.isdigit():
                devices.add(os.makedev(int(major), int(minor)))
    return devices


def check_name(name: str) -> None:
    if not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise InvalidInput(
            f"shared memory region name {quoted(name)} must be 1-{MAX_NAME} printable characters"
        )


def check_key(key: str) -> None:
    if not _KEY.fullmatch(key) or key in ("/.", "/.."):
        raise InvalidInput(
            f"shared memory key {quoted(key)} must be a POSIX shared memory name: {_KEY_RULE}"
        )
