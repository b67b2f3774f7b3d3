"""Copy mode's views (`Regions(copy=True)`): a buffer of this process's own per view, an
input's read in with preadv, an output's written back with pwrite on release."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

from sluice.core.errors import InvalidInput, Overloaded, SluiceError
from sluice.shm.objects import Region, RegionInfo


class Copy:
    """A copy mode view's buffer: `size` bytes of `region`'s object from its offset `at`; if
    `write`, an output's, whose first `wrote` bytes go back there when its lease is released
    after a call that succeeded."""

    __slots__ = ("at", "buffer", "region", "size", "write", "wrote")

    def __init__(self, region: Region, at: int, buffer: mmap.mmap, size: int, write: bool) -> None:
        self.region = region
        self.at = at
        self.buffer = buffer  # anonymous memory: page aligned, as ONNX Runtime likes its input
        self.size = size
        self.write = write
        self.wrote = 0  # marked by Lease.wrote: what the call's writer put there


def rounded(size: int) -> int:
    """A buffer's length for `size` bytes: whole pages, so that near sizes share a pool."""
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def truncated(info: RegionInfo, size: int, end: int) -> InvalidInput:
    return InvalidInput(
        f"shared memory region '{info.name}': its object '{info.key}' is {size} bytes now, "
        f"short of the {end} this call uses (truncated since it was registered)"
    )


def zero(buffer: mmap.mmap, size: int) -> None:
    """Zero the first `size` bytes of a pooled buffer."""
    into = memoryview(buffer)
    try:  # released at once: the pool counts views
        np.frombuffer(into, np.uint8, size).fill(0)
    finally:
        into.release()


def read_in(copy: Copy) -> None:
    """Fill an input's `copy` from its object."""
    into = memoryview(copy.buffer)
    got = 0
    try:  # released at once, even when a traceback keeps this frame: the pool counts views
        while got < copy.size:
            n = os.preadv(copy.region.fd, [into[got : copy.size]], copy.at + got)
            if not n:  # the object ends short of the view: its caller truncated it
                size = min(os.fstat(copy.region.fd).st_size, copy.at + got)
                raise truncated(copy.region.info, size, copy.at + copy.size)
            got += n
    except OSError as exc:
        info = copy.region.info
        raise unmoved(
            exc,
            f"shared memory region '{info.name}': the call's input of {copy.size} bytes at "
            f"offset {copy.at - info.offset} could not be read from '{info.key}' (its first "
            f"{got} were): {exc.strerror}",
        ) from None
    finally:
        into.release()


def write_back(copy: Copy) -> SluiceError | None:
    """Write the bytes the call marked in an output's buffer to its object; None if done,
    else why not."""
    out = memoryview(copy.buffer)
    done = 0
    try:
        while done < copy.wrote:
            done += os.pwrite(copy.region.fd, out[done : copy.wrote], copy.at + done)
    except OSError as exc:
        info = copy.region.info
        return unmoved(
            exc,
            f"shared memory region '{info.name}': the call's output of {copy.wrote} bytes at "
            f"offset {copy.at - info.offset} could not be written to '{info.key}' (its first "
            f"{done} were): {exc.strerror}",
        )
    finally:
        out.release()
    return None


def unmoved(exc: OSError, why: str) -> SluiceError:
    """A copy's read or write that failed: RESOURCE_EXHAUSTED where memory or /dev/shm ran
    out (as a caller's sparse object can make it), INTERNAL otherwise."""
    if exc.errno in (errno.ENOMEM, errno.ENOSPC):
        return Overloaded(f"overloaded: {why}")
    return SluiceError(why)
