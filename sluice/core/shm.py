"""The shared memory regions callers on this host register (Triton's system shared memory
extension, and the sluice.v1 API's): a POSIX shared memory object the caller wrote a tensor
into, mapped once here, from which calls read inputs and into which they write outputs in
place. Transport-free: the gRPC faces turn requests into these calls, and these errors into
statuses.

A caller that truncates its object while a call reads or writes the mapping would have the
server take SIGBUS and die (the size check before each view narrows that window, it cannot
close it: POSIX shm objects cannot be sealed). Where callers are not all trusted (tenants),
`Regions(copy=True)` maps nothing: a view is a buffer of this process's own, read from the
object with preadv (a short read refuses the call) and, for an output, written back with
pwrite when the lease is released (past a truncated end it just extends the caller's object).

Each tenant has its own name space ("" when tenants are off: one for everyone): a name
another tenant registered is, to a caller, one nobody registered. A call takes a `Lease`
and reads and writes through it; a region unregistered under a running call loses its name
at once, its mapping only when the last lease on it is released."""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import re
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from sluice.core.errors import (
    AlreadyExists,
    InvalidInput,
    QuotaExceeded,
    RegionBusy,
    RegionNotFound,
    SluiceError,
)

SHM_ROOT = Path("/dev/shm")  # where POSIX shm objects live on Linux; Regions(root=...) for tests
MAX_NAME = 256
_KEY = re.compile(r"/[A-Za-z0-9._-]{1,250}")
_KEY_RULE = "'/' then 1-250 of A-Z a-z 0-9 . _ - (not '/.' or '/..', no other '/')"
_MOUNTS = Path("/proc/self/mountinfo")
# Open without following a symlink, without blocking on a FIFO, and kept from children.
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
# Copy mode's buffers kept for reuse (a steady call faults no fresh pages): per size (a few
# calls at once of one shape), and in all.
POOL_PER_SIZE = 4
POOL_BYTES = 64 << 20
# References to a buffer held only by its _Copy, as sys.getrefcount counts them (the slot and
# the call's argument); one more is a view of it a caller still holds.
_BARE = 2


@dataclass(frozen=True)
class RegionInfo:
    """A registered region, as Status reports it."""

    name: str
    key: str
    offset: int
    byte_size: int


class _Region:
    """A registered region: its object's fd (kept, to check its size and links, and in copy
    mode to read and write it), the mapping from the page at or below its offset (None in
    copy mode), and the leases using it."""

    __slots__ = ("fd", "gone", "holders", "info", "inode", "map", "start", "writing")

    def __init__(self, info: RegionInfo, fd: int, mapped: mmap.mmap | None, start: int) -> None:
        self.info = info
        self.fd = fd
        st = os.fstat(fd)
        self.inode = st.st_dev, st.st_ino  # the object, whatever name reached it
        self.map: mmap.mmap | None = mapped
        self.start = start  # where the region begins in the mapping
        self.holders = 0  # leases that used it and are not released
        self.gone = False  # unregistered: closed when the last holder releases
        self.writing: dict[int, list[tuple[int, int]]] = {}  # lease id: [start, end) written

    def close(self) -> None:
        mapped, self.map = self.map, None
        if mapped is not None:
            # Views of it may outlive the call (a caller's array): it goes with the last.
            with contextlib.suppress(BufferError):
                mapped.close()
        os.close(self.fd)


class _Copy:
    """A copy mode view's buffer: `size` bytes of `region`'s object from its offset `at`,
    written back there when its lease is released if `write`."""

    __slots__ = ("at", "buffer", "region", "size", "write")

    def __init__(self, region: _Region, at: int, buffer: mmap.mmap, size: int, write: bool) -> None:
        self.region = region
        self.at = at
        self.buffer = buffer  # anonymous memory: page aligned, as ONNX Runtime likes its input
        self.size = size
        self.write = write


def _shown(text: str) -> str:
    """`text` quoted as Triton quotes names; escaped and cut short when a caller sent junk."""
    if len(text) <= MAX_NAME and text.isprintable():
        return f"'{text}'"
    return repr(text[:64]) + ("..." if len(text) > 64 else "")


def _tmpfs_devices() -> set[int]:
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


def _check_name(name: str) -> None:
    if not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise InvalidInput(
            f"shared memory region name {_shown(name)} must be 1-{MAX_NAME} printable characters"
        )


def _check_key(key: str) -> None:
    if not _KEY.fullmatch(key) or key in ("/.", "/.."):
        raise InvalidInput(
            f"shared memory key {_shown(key)} must be a POSIX shared memory name: {_KEY_RULE}"
        )


class Regions:
    """The regions registered on this process, by tenant and name, within per-tenant bounds
    on their number and the bytes they span together."""

    def __init__(
        self,
        *,
        max_regions: int = 64,
        max_bytes: int = 4 << 30,
        root: Path = SHM_ROOT,
        require_tmpfs: bool | None = None,
        copy: bool = False,
    ) -> None:
        """`require_tmpfs`: refuse objects not on a tmpfs; by default only for SHM_ROOT, as a
        test's root is a plain directory (on a host whose /dev/shm is a directory on the root
        filesystem, a hard link there could reach any file the server may write). `copy`:
        map no object, copy each view in and out (no caller can make the server fault)."""
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.root = Path(root)
        self.require_tmpfs = self.root == SHM_ROOT if require_tmpfs is None else require_tmpfs
        self.copy = copy
        self._lock = threading.Lock()  # leases may be released from another thread
        self._tenants: dict[str, dict[str, _Region]] = {}
        self._ids = itertools.count(1)
        self._pool: dict[int, list[mmap.mmap]] = {}  # copy mode's idle buffers, by length
        self._pooled = 0  # their bytes

    def __len__(self) -> int:
        with self._lock:
            return sum(len(held) for held in self._tenants.values())

    def register(self, tenant: str, name: str, key: str, offset: int, byte_size: int) -> None:
        """Take `byte_size` bytes at `offset` of the object `key` as `tenant`'s region `name`
        (mapped, unless in copy mode)."""
        _check_name(name)
        _check_key(key)
        if offset < 0:
            raise InvalidInput(
                f"shared memory region '{name}': offset must be 0 or more, got {offset}"
            )
        if byte_size < 1:
            raise InvalidInput(
                f"shared memory region '{name}': byte size must be 1 or more, got {byte_size}"
            )
        with self._lock:  # the cheap refusals before touching the object
            self._admit(tenant, name, byte_size)
        region = self._open(name, key, offset, byte_size)
        with self._lock:  # again: another call may have taken the name or room meanwhile
            try:
                self._admit(tenant, name, byte_size)
                self._unshared(tenant, region)
            except SluiceError:
                region.close()
                raise
            self._tenants.setdefault(tenant, {})[name] = region

    def status(self, tenant: str, name: str = "") -> list[RegionInfo]:
        """`tenant`'s region `name`, or all its regions ("") by name."""
        with self._lock:
            held = self._tenants.get(tenant, {})
            if not name:
                return [held[n].info for n in sorted(held)]
            region = held.get(name)
            if region is None:
                raise RegionNotFound(f"Unable to find system shared memory region: {_shown(name)}")
            return [region.info]

    def unregister(self, tenant: str, name: str = "") -> None:
        """Forget `tenant`'s region `name`, or all its regions (""); an unknown name is no
        error (as in Triton). A leased region is unmapped when its last lease releases."""
        with self._lock:
            held = self._tenants.get(tenant, {})
            names = [name] if name else list(held)
            closing = self._remove(tenant, [n for n in names if n in held])
        for region in closing:
            region.close()

    def sweep(self) -> list[str]:
        """Unregister the regions whose object was unlinked (its caller is done with it, or
        gone); the names swept."""
        with self._lock:
            swept: list[str] = []
            closing: list[_Region] = []
            for tenant, held in list(self._tenants.items()):
                names = [n for n, r in held.items() if os.fstat(r.fd).st_nlink == 0]
                swept += names
                closing += self._remove(tenant, names)
        for region in closing:
            region.close()
        return swept

    def close(self) -> None:
        """Unregister every region (shutdown); leased ones go when their leases release."""
        with self._lock:
            closing = [r for t in list(self._tenants) for r in self._remove(t, None)]
            self._pool.clear()
            self._pooled = 0
        for region in closing:
            region.close()

    def lease(self, tenant: str) -> Lease:
        """One call's use of `tenant`'s regions."""
        return Lease(self, tenant)

    def _admit(self, tenant: str, name: str, byte_size: int) -> None:
        """Refuse a name taken or a region past the tenant's bounds (under the lock)."""
        held = self._tenants.get(tenant, {})
        if name in held:
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        whose = f"tenant {tenant} has" if tenant else "callers have"
        if len(held) >= self.max_regions:
            raise QuotaExceeded(
                f"quota: {whose} {len(held)} shared memory regions registered, the most allowed "
                f"(--shared-memory-regions {self.max_regions}); unregister one first"
            )
        total = sum(r.info.byte_size for r in held.values()) + byte_size
        if total > self.max_bytes:
            raise QuotaExceeded(
                f"quota: shared memory region '{name}' would bring the bytes {whose} registered "
                f"to {total}, over the most allowed (--shared-memory-bytes {self.max_bytes}); "
                "unregister a region first"
            )

    def _unshared(self, tenant: str, region: _Region) -> None:
        """Refuse an object another tenant registered (under the lock): the server may open
        what that tenant's caller made for it alone. Answered as for a missing object, so a
        tenant cannot learn which objects others use."""
        for other, held in self._tenants.items():
            if other != tenant and any(r.inode == region.inode for r in held.values()):
                raise InvalidInput(f"Unable to open shared memory region: '{region.info.key}'")

    def _open(self, name: str, key: str, offset: int, byte_size: int) -> _Region:
        try:
            fd = os.open(os.path.join(self.root, key[1:]), _OPEN)
        except FileNotFoundError:
            raise InvalidInput(f"Unable to open shared memory region: '{key}'") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):  # ELOOP: a symlink, O_NOFOLLOW
                what = "a symbolic link" if exc.errno == errno.ELOOP else "a directory"
                raise InvalidInput(
                    f"shared memory key '{key}' is not shared memory: {what}"
                ) from None
            raise InvalidInput(
                f"Unable to open shared memory region: '{key}': {exc.strerror}"
            ) from None
        try:
            st = os.fstat(fd)
            self._check_object(key, st)
            end = offset + byte_size
            if end > st.st_size:
                raise InvalidInput(
                    f"shared memory region '{name}': offset {offset} + byte size {byte_size} "
                    f"is past the end of '{key}' ({st.st_size} bytes)"
                )
            if self.copy:
                return _Region(RegionInfo(name, key, offset, byte_size), fd, None, 0)
            page = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap's offset is aligned
            try:
                mapped = mmap.mmap(
                    fd,
                    end - page,
                    flags=mmap.MAP_SHARED,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    offset=page,
                )
            except (OSError, OverflowError, ValueError) as exc:
                raise SluiceError(
                    f"Unable to map shared memory region '{name}' ('{key}'): {exc}"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        return _Region(RegionInfo(name, key, offset, byte_size), fd, mapped, offset - page)

    def _check_object(self, key: str, st: os.stat_result) -> None:
        """Refuse what is not a shm object: not a regular file, on another filesystem than
        the root (a file bind-mounted there), or, where required, not on a tmpfs."""
        why = ""
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_dev != os.stat(self.root).st_dev:
            why = f"on another filesystem than {self.root}"
        elif self.require_tmpfs and st.st_dev not in _tmpfs_devices():
            why = f"{self.root} is not a tmpfs"
        if why:
            raise InvalidInput(f"shared memory key '{key}' is not shared memory: {why}")

    def _remove(self, tenant: str, names: list[str] | None) -> list[_Region]:
        """Take `names` (None: all) of `tenant`'s regions out of the table (under the lock);
        those no lease holds, to close once the lock is let go."""
        held = self._tenants.get(tenant, {})
        taken = [held.pop(n) for n in (list(held) if names is None else names)]
        if not held:
            self._tenants.pop(tenant, None)
        for region in taken:
            region.gone = True
        return [r for r in taken if not r.holders]

    def _view(
        self, lease: Lease, name: str, offset: int, byte_size: int, write: bool
    ) -> memoryview:
        with self._lock:
            if lease._released:
                raise _after_release()
            region = self._tenants.get(lease.tenant, {}).get(name)
            if region is None:
                raise InvalidInput(f"Unable to find shared memory region: {_shown(name)}")
            info = region.info
            if offset < 0 or byte_size < 0 or offset + byte_size > info.byte_size:
                raise InvalidInput(
                    f"Invalid offset + byte size for shared memory region: '{name}' (offset "
                    f"{offset} + byte size {byte_size}, in a region of {info.byte_size} bytes)"
                )
            at = info.offset + offset
            if not self.copy or not byte_size:  # a copy's read checks the size as it reads
                # A caller that shrank its object would have us fault (SIGBUS) past its end.
                size = os.fstat(region.fd).st_size
                if at + byte_size > size:
                    raise _truncated(info, size, at + byte_size)
            if write and byte_size:
                self._claim(region, lease._id, name, offset, offset + byte_size)
            if all(r is not region for r in lease._held):
                lease._held.append(region)
                region.holders += 1
            if self.copy:
                if not byte_size:
                    return memoryview(bytearray()) if write else memoryview(b"")
                earlier = [c for c in lease._copies if c.write and c.region.inode == region.inode]
            else:
                assert region.map is not None  # mapped while registered or held
                start = region.start + offset
                view = memoryview(region.map)[start : start + byte_size]
                return view if write else view.toreadonly()
        return self._copied(lease, region, at, byte_size, write, earlier)

    def _copied(
        self,
        lease: Lease,
        region: _Region,
        at: int,
        size: int,
        write: bool,
        earlier: list[_Copy],
    ) -> memoryview:
        """A copy mode view of `size` bytes from `at` in `region`'s object, read outside the
        lock into a buffer (a pooled one if idle), over which the lease's `earlier` outputs
        into the object lie (a call reads what it wrote). Only the _Copy made here refers to
        the buffer: the pool takes it back only while that is so."""
        with self._lock:
            buffer = self._take(size)
        if buffer is None:
            try:
                buffer = mmap.mmap(-1, _rounded(size))
            except OSError as exc:
                with self._lock:
                    self._unclaim(lease, region, at, size, write)
                raise SluiceError(
                    f"shared memory region '{region.info.name}': no memory for a copy of "
                    f"{size} bytes: {exc.strerror}"
                ) from None
        copy = _Copy(region, at, buffer, size, write)
        del buffer
        try:
            _read(copy, earlier)
        except SluiceError:
            with self._lock:
                self._unclaim(lease, region, at, size, write)
                self._keep(copy)
            raise
        with self._lock:
            if lease._released:  # released on another thread during the read
                self._keep(copy)
                raise _after_release()
            lease._copies.append(copy)
        view = memoryview(copy.buffer)[:size]
        return view if write else view.toreadonly()

    @staticmethod
    def _unclaim(lease: Lease, region: _Region, at: int, size: int, write: bool) -> None:
        """Take back the claim of a view refused (under the lock): as in mapped mode, none
        is left behind."""
        ranges = region.writing.get(lease._id) if write else None
        if ranges is None:
            return
        start = at - region.info.offset
        ranges.remove((start, start + size))
        if not ranges:
            del region.writing[lease._id]

    @staticmethod
    def _claim(region: _Region, lease: int, name: str, start: int, end: int) -> None:
        """Mark [start, end) as written by `lease`, unless another lease writes into it."""
        for other, ranges in region.writing.items():
            if other == lease:
                continue
            for lo, hi in ranges:
                if lo < end and start < hi:
                    raise RegionBusy(
                        f"shared memory region '{name}': bytes [{start}, {end}) overlap bytes "
                        f"[{lo}, {hi}) another call is writing; retry when it ends, or give "
                        "each call its own range"
                    )
        region.writing.setdefault(lease, []).append((start, end))

    def _take(self, size: int) -> mmap.mmap | None:
        """A pooled buffer for `size` bytes, if one is idle (under the lock)."""
        length = _rounded(size)
        kept = self._pool.get(length)
        if kept is None:
            return None
        buffer = kept.pop()
        if not kept:  # an emptied size goes: the keys are as bounded as the buffers
            del self._pool[length]
        self._pooled -= length
        return buffer

    def _keep(self, copy: _Copy) -> None:
        """Pool `copy`'s buffer (under the lock), unless the pool is full or a view of it
        outlived its call: that one goes when the view does, never to another call."""
        length = len(copy.buffer)
        if (
            sys.getrefcount(copy.buffer) == _BARE
            and len(self._pool.get(length, ())) < POOL_PER_SIZE
            and self._pooled + length <= POOL_BYTES
        ):
            self._pool.setdefault(length, []).append(copy.buffer)
            self._pooled += length

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            copies, lease._copies = lease._copies, []
        # The outputs land before their ranges are free to other calls, and while the lease
        # still holds their regions' fds (an unregistered region's too, as in mapped mode).
        failed = [why for why in (_written(c) for c in copies if c.write) if why]
        with self._lock:
            closing: list[_Region] = []
            for region in lease._held:
                region.writing.pop(lease._id, None)
                region.holders -= 1
                if region.gone and not region.holders:
                    closing.append(region)
            lease._held.clear()
            for copy in copies:
                self._keep(copy)
        for region in closing:
            region.close()
        if failed:
            raise SluiceError("; ".join(failed))


def _rounded(size: int) -> int:
    """A buffer's length for `size` bytes: whole pages, so that near sizes share a pool."""
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def _after_release() -> SluiceError:
    return SluiceError("a call's shared memory lease was used after its release")


def _truncated(info: RegionInfo, size: int, end: int) -> InvalidInput:
    return InvalidInput(
        f"shared memory region '{info.name}': its object '{info.key}' is {size} bytes now, "
        f"short of the {end} this call uses (truncated since it was registered)"
    )


def _read(copy: _Copy, earlier: list[_Copy]) -> None:
    """Fill `copy` from its object, then with what the `earlier` outputs over it hold."""
    into = memoryview(copy.buffer)
    try:  # released at once, even when a traceback keeps this frame: the pool counts views
        got = 0
        while got < copy.size:
            n = os.preadv(copy.region.fd, [into[got : copy.size]], copy.at + got)
            if not n:  # the object ends short of the view: its caller truncated it
                size = min(os.fstat(copy.region.fd).st_size, copy.at + got)
                raise _truncated(copy.region.info, size, copy.at + copy.size)
            got += n
        end = copy.at + copy.size
        for other in earlier:
            lo, hi = max(copy.at, other.at), min(end, other.at + other.size)
            if lo < hi:
                into[lo - copy.at : hi - copy.at] = other.buffer[lo - other.at : hi - other.at]
    finally:
        into.release()


def _written(copy: _Copy) -> str:
    """Write an output's buffer to its object; "" if done, else why not."""
    out = memoryview(copy.buffer)
    done = 0
    try:
        while done < copy.size:
            done += os.pwrite(copy.region.fd, out[done : copy.size], copy.at + done)
    except OSError as exc:
        info = copy.region.info
        return (
            f"shared memory region '{info.name}': the call's output of {copy.size} bytes at "
            f"offset {copy.at - info.offset} could not be written to '{info.key}' (its first "
            f"{done} were): {exc.strerror}"
        )
    finally:
        out.release()
    return ""


class Lease:
    """One call's hold on the regions it reads and writes; release() when the call ends
    (idempotent; also a context manager)."""

    def __init__(self, regions: Regions, tenant: str) -> None:
        self.used = False  # True once input() or output() was called
        self.tenant = tenant
        self._regions = regions
        self._id = next(regions._ids)
        self._held: list[_Region] = []
        self._copies: list[_Copy] = []  # copy mode's views, in the order taken
        self._released = False

    def input(self, region: str, offset: int, byte_size: int) -> memoryview:
        """A read-only view of `byte_size` bytes at `offset` of the caller's `region`."""
        self.used = True
        return self._regions._view(self, region, offset, byte_size, write=False)

    def output(self, region: str, offset: int, byte_size: int) -> memoryview:
        """A writable view of `byte_size` bytes at `offset` of the caller's `region`, which
        no other lease may write into until this one is released (in copy mode, when they
        are written to it)."""
        self.used = True
        return self._regions._view(self, region, offset, byte_size, write=True)

    def release(self) -> None:
        """Let go of the regions; in copy mode, first write the outputs to their objects
        (SluiceError if one could not be: the rest is let go all the same)."""
        self._regions._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
