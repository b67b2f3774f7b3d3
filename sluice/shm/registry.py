"""The shared memory regions callers on this host register (Triton's system shared memory
extension, and sluice.v1's): a POSIX shm object the caller wrote a tensor into, mapped once,
from which calls read inputs and into which they write outputs in place. Transport-free.

A caller that truncates its object under a call would have the server take SIGBUS (POSIX
shm cannot be sealed): where callers are not all trusted (tenants), `Regions(copy=True)`
maps nothing, and a view is a buffer of this process's own, read with preadv and written
back with pwrite on release, only the bytes marked (`wrote`) of a call that succeeded,
within `max_copy_bytes` in flight.

Each tenant has its own name space ("" with tenants off). A call reads and writes through a
`Lease`; a region unregistered under it loses its name at once, its mapping when the last
lease goes."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import stat
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from sluice.core.errors import (
    AlreadyExists,
    InvalidInput,
    Overloaded,
    QuotaExceeded,
    RegionBusy,
    RegionNotFound,
    SluiceError,
)
from sluice.shm.copies import Copy, read_in, rounded, truncated, write_back, zero
from sluice.shm.objects import MAX_NAME as MAX_NAME
from sluice.shm.objects import SHM_ROOT as SHM_ROOT
from sluice.shm.objects import Region, check_key, check_name, quoted
from sluice.shm.objects import RegionInfo as RegionInfo
from sluice.shm.objects import tmpfs_devices as tmpfs_devices

# Open without following a symlink, without blocking on a FIFO, and kept from children.
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
# Copy mode's buffers kept for reuse (a steady call faults no fresh pages): per size (a few
# calls at once of one shape), and in all.
POOL_PER_SIZE = 4
POOL_BYTES = 64 << 20
# Copy mode's bound on the bytes the calls in flight hold in copies, all tenants together: a
# region's size is bounded by --shared-memory-bytes, not how many calls copy it at once.
MAX_COPY_BYTES = 256 << 20
# References to a buffer held only by its Copy, as sys.getrefcount counts them (the slot and
# the call's argument); one more is a view of it a caller still holds.
_BARE = 2


class _Claim(NamedTuple):
    """Bytes [start, end) of an object that a lease writes into, through region `name`,
    which begins at `offset` of the object."""

    start: int
    end: int
    name: str
    offset: int


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
        max_copy_bytes: int = MAX_COPY_BYTES,
    ) -> None:
        """`require_tmpfs`: refuse objects not on a tmpfs (default: only for SHM_ROOT; a hard
        link in a plain-directory /dev/shm could reach any file). `copy`: map nothing, copy
        views in and out, within `max_copy_bytes` for the calls in flight."""
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.root = Path(root)
        self.require_tmpfs = self.root == SHM_ROOT if require_tmpfs is None else require_tmpfs
        self.copy = copy
        self.max_copy_bytes = max_copy_bytes
        self._copying = 0  # the bytes of the copies leases hold now
        self._lock = threading.Lock()  # leases may be released from another thread
        self._tenants: dict[str, dict[str, Region]] = {}
        self._ids = itertools.count(1)
        # The bytes each lease writes into, by object (whatever region names reach it).
        self._writing: dict[tuple[int, int], dict[int, list[_Claim]]] = {}
        self._pool: dict[int, list[mmap.mmap]] = {}  # copy mode's idle buffers, by length
        self._pooled = 0  # their bytes

    def __len__(self) -> int:
        with self._lock:
            return sum(len(held) for held in self._tenants.values())

    def register(self, tenant: str, name: str, key: str, offset: int, byte_size: int) -> None:
        """Take `byte_size` bytes at `offset` of the object `key` as `tenant`'s region `name`
        (mapped, unless in copy mode)."""
        check_name(name)
        check_key(key)
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
                raise RegionNotFound(f"Unable to find system shared memory region: {quoted(name)}")
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
            closing: list[Region] = []
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

    def _unshared(self, tenant: str, region: Region) -> None:
        """Refuse an object another tenant registered (under the lock): the server may open
        what that tenant's caller made for it alone. Answered as for a missing object, so a
        tenant cannot learn which objects others use."""
        for other, held in self._tenants.items():
            if other != tenant and any(r.inode == region.inode for r in held.values()):
                raise InvalidInput(f"Unable to open shared memory region: '{region.info.key}'")

    def _open(self, name: str, key: str, offset: int, byte_size: int) -> Region:
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
                return Region(RegionInfo(name, key, offset, byte_size), fd, None, 0)
            page = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap's offset is aligned
            try:
                mapped = mmap.mmap(
                    fd,
                    end - page,
                    flags=mmap.MAP_SHARED,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    offset=page,
                )
            except OSError as exc:  # out of address space or map count: a huge region
                raise Overloaded(
                    f"overloaded: unable to map shared memory region '{name}' ('{key}', "
                    f"{byte_size} bytes): {exc.strerror}; unregister regions, or register a "
                    "smaller one"
                ) from None
            except (OverflowError, ValueError) as exc:
                raise SluiceError(
                    f"Unable to map shared memory region '{name}' ('{key}'): {exc}"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        return Region(RegionInfo(name, key, offset, byte_size), fd, mapped, offset - page)

    def _check_object(self, key: str, st: os.stat_result) -> None:
        """Refuse what is not a shm object: not a regular file, on another filesystem than
        the root (a file bind-mounted there), or, where required, not on a tmpfs."""
        why = ""
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_dev != os.stat(self.root).st_dev:
            why = f"on another filesystem than {self.root}"
        elif self.require_tmpfs and st.st_dev not in tmpfs_devices():
            why = f"{self.root} is not a tmpfs"
        if why:
            raise InvalidInput(f"shared memory key '{key}' is not shared memory: {why}")

    def _remove(self, tenant: str, names: list[str] | None) -> list[Region]:
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
                raise InvalidInput(f"Unable to find shared memory region: {quoted(name)}")
            info = region.info
            if offset < 0 or byte_size < 0 or offset + byte_size > info.byte_size:
                raise InvalidInput(
                    f"Invalid offset + byte size for shared memory region: '{name}' (offset "
                    f"{offset} + byte size {byte_size}, in a region of {info.byte_size} bytes)"
                )
            at = info.offset + offset
            # Copied, an input's read checks the size as it reads (an output's write-back
            # past a truncated end just extends the object).
            if not self.copy or not byte_size:
                # A caller that shrank its object would have us fault (SIGBUS) past its end.
                size = os.fstat(region.fd).st_size
                if at + byte_size > size:
                    raise truncated(info, size, at + byte_size)
            if write and byte_size:
                self._claim(region, lease._id, offset, offset + byte_size)
            if all(r is not region for r in lease._held):
                lease._held.append(region)
                region.holders += 1
            if self.copy:
                if not byte_size:
                    return memoryview(bytearray()) if write else memoryview(b"")
                self._reserve(lease, region, at, byte_size, write)
            else:
                assert region.map is not None  # mapped while registered or held
                start = region.start + offset
                view = memoryview(region.map)[start : start + byte_size]
                return view if write else view.toreadonly()
        return self._copied(lease, region, at, byte_size, write)

    def _reserve(self, lease: Lease, region: Region, at: int, size: int, write: bool) -> None:
        """Count a copy of `size` bytes against `max_copy_bytes` (under the lock), or refuse
        it, its claim taken back."""
        total = self._copying + size
        if total > self.max_copy_bytes:
            self._unclaim(lease, region, at, size, write)
            raise QuotaExceeded(
                f"quota: shared memory region '{region.info.name}': a copy of {size} bytes "
                f"would bring the bytes the calls in flight copy to {total}, over the most "
                f"allowed ({self.max_copy_bytes}, sluice.shm.registry.MAX_COPY_BYTES); retry when "
                "calls end, or place smaller ranges"
            )
        self._copying = total

    def _copied(self, lease: Lease, region: Region, at: int, size: int, write: bool) -> memoryview:
        """A copy mode view of `size` bytes from `at` (counted by `_reserve`) in a buffer, pooled
        if one is idle: an input's read outside the lock, an output's zeroed. Only its Copy
        refers to the buffer, so the pool can tell when a view outlived the call."""
        with self._lock:
            buffer = self._take(size)
        if buffer is None:
            try:
                buffer = mmap.mmap(-1, rounded(size))  # zeros, its pages faulted when used
            except OSError as exc:
                with self._lock:
                    self._unclaim(lease, region, at, size, write)
                    self._copying -= size
                raise Overloaded(
                    f"overloaded: shared memory region '{region.info.name}': no memory for a "
                    f"copy of {size} bytes ({exc.strerror}); retry later, or place smaller ranges"
                ) from None
        elif write:  # another call's bytes are not this one's to see
            zero(buffer, size)
        copy = Copy(region, at, buffer, size, write)
        del buffer
        try:
            if not write:
                read_in(copy)
        except SluiceError:
            with self._lock:
                self._unclaim(lease, region, at, size, write)
                self._copying -= size
                self._keep(copy)
            raise
        with self._lock:
            if lease._released:  # released on another thread during the read
                self._copying -= size
                self._keep(copy)
                raise _after_release()
            lease._copies.append(copy)
        view = memoryview(copy.buffer)[:size]
        return view if write else view.toreadonly()

    def _wrote(self, lease: Lease, view: memoryview, nbytes: int) -> None:
        if not 0 <= nbytes <= len(view):
            raise ValueError(f"{nbytes} bytes marked written in a view of {len(view)}")
        if not self.copy or not nbytes:  # a mapped view is the object: nothing to write back
            return
        with self._lock:
            for copy in reversed(lease._copies):
                if copy.write and copy.buffer is view.obj:
                    copy.wrote = max(copy.wrote, nbytes)
                    return
        raise ValueError("bytes marked written in a view that is not one of this lease's outputs")

    def _unclaim(self, lease: Lease, region: Region, at: int, size: int, write: bool) -> None:
        """Take back the claim of a view refused (under the lock): as in mapped mode, none
        is left behind."""
        claims = self._writing.get(region.inode, {}).get(lease._id) if write else None
        if claims is None:
            return
        claims.pop(next(i for i in reversed(range(len(claims))) if claims[i].start == at))
        if not claims:
            self._unclaimed(region.inode, lease._id)

    def _unclaimed(self, inode: tuple[int, int], lease: int) -> None:
        """Forget what `lease` writes into the object `inode` (under the lock)."""
        by_lease = self._writing.get(inode, {})
        by_lease.pop(lease, None)
        if not by_lease:
            self._writing.pop(inode, None)

    def _claim(self, region: Region, lease: int, start: int, end: int) -> None:
        """Mark bytes [start, end) of `region` as written by `lease`, unless a lease writes
        into them already, through this region or another of its object: another call
        (RegionBusy), or this one (two outputs over each other would leave the caller one of
        them, unsaid)."""
        name, base = region.info.name, region.info.offset
        claims = self._writing.setdefault(region.inode, {})
        for other, taken in claims.items():
            for claim in taken:
                if claim.start < base + end and base + start < claim.end:
                    where = f"bytes [{claim.start - claim.offset}, {claim.end - claim.offset})"
                    if claim.name != name:
                        where += f" of region '{claim.name}' (the same object)"
                    if other == lease:
                        raise InvalidInput(
                            f"shared memory region '{name}': bytes [{start}, {end}) overlap "
                            f"{where} this call writes another output into; give each output "
                            "its own bytes"
                        )
                    raise RegionBusy(
                        f"shared memory region '{name}': bytes [{start}, {end}) overlap "
                        f"{where} another call is writing; retry when it ends, or give each "
                        "call its own range"
                    )
        claims.setdefault(lease, []).append(_Claim(base + start, base + end, name, base))

    def _take(self, size: int) -> mmap.mmap | None:
        """A pooled buffer for `size` bytes, if one is idle (under the lock)."""
        length = rounded(size)
        kept = self._pool.get(length)
        if kept is None:
            return None
        buffer = kept.pop()
        if not kept:  # an emptied size goes: the keys are as bounded as the buffers
            del self._pool[length]
        self._pooled -= length
        return buffer

    def _keep(self, copy: Copy) -> None:
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

    def _release(self, lease: Lease, ok: bool) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            copies, lease._copies = lease._copies, []
        # The outputs land before their ranges are free to other calls, and while the lease
        # still holds their regions' fds (an unregistered region's too, as in mapped mode).
        failed = [write_back(c) for c in copies if ok and c.write and c.wrote]
        with self._lock:
            closing: list[Region] = []
            for region in lease._held:
                self._unclaimed(region.inode, lease._id)
                region.holders -= 1
                if region.gone and not region.holders:
                    closing.append(region)
            lease._held.clear()
            for copy in copies:
                self._copying -= copy.size
                self._keep(copy)
        for region in closing:
            region.close()
        errors = [why for why in failed if why is not None]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            full = all(isinstance(e, Overloaded) for e in errors)
            raise (Overloaded if full else SluiceError)("; ".join(map(str, errors)))


def _after_release() -> SluiceError:
    return SluiceError("a call's shared memory lease was used after its release")


class Lease:
    """One call's hold on the regions it reads and writes; release() when the call ends
    (idempotent; also a context manager)."""

    def __init__(self, regions: Regions, tenant: str) -> None:
        self.tenant = tenant
        self._regions = regions
        self._id = next(regions._ids)
        self._held: list[Region] = []
        self._copies: list[Copy] = []  # copy mode's views, in the order taken
        self._released = False

    def input(self, region: str, offset: int, byte_size: int) -> memoryview:
        """A read-only view of `byte_size` bytes at `offset` of the caller's `region`."""
        return self._regions._view(self, region, offset, byte_size, write=False)

    def output(self, region: str, offset: int, byte_size: int) -> memoryview:
        """A writable view of `byte_size` bytes at `offset` of the caller's `region`, which
        no other lease may write into until this one is released (in copy mode, when they
        are written to it). In copy mode it holds zeros, not the object's bytes, and goes
        to the object only as far as `wrote` marks it."""
        return self._regions._view(self, region, offset, byte_size, write=True)

    def wrote(self, view: memoryview, nbytes: int) -> None:
        """Mark the first `nbytes` of an output `view` as the call's: in copy mode, what its
        release writes back (a mapped view is the object itself)."""
        self._regions._wrote(self, view, nbytes)

    def release(self, ok: bool = True) -> None:
        """Let go of the regions; in copy mode, first write the bytes the outputs marked to
        their objects, unless the call failed (not `ok`: a failed, cancelled or expired call
        writes nothing). SluiceError if one could not be written: the rest is let go all
        the same."""
        self._regions._release(self, ok)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release(ok=kind is None)
