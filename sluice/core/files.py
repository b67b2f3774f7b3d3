"""When a watched file changed: its stamp, compared between looks."""

from __future__ import annotations

import os

Stamp = tuple[int, int, int]


def stamp(path: str | os.PathLike[str]) -> Stamp | None:
    """The file's (mtime_ns, size, inode), None while missing. The inode catches a rename
    within one clock tick (how Kubernetes updates a mounted Secret)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino
