"""sluice.shm.registry: the shared memory region registry, on real objects in /dev/shm (each test
in its own directory there, removed after it), and its leases' views; each test in both modes
(mapped, and copy: whose views are buffers of the server's own) where it holds in both."""

from __future__ import annotations

import contextlib
import errno
import gc
import itertools
import mmap
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from sluice.core.errors import (
    AlreadyExists,
    InvalidInput,
    QuotaExceeded,
    RegionBusy,
    RegionNotFound,
    SluiceError,
)
from sluice.runtime.status import status_of
from sluice.shm import registry as shm
from sluice.shm.registry import SHM_ROOT, RegionInfo, Regions

PAGE = mmap.ALLOCATIONGRANULARITY

pytestmark = pytest.mark.skipif(
    not SHM_ROOT.is_dir() or os.stat(SHM_ROOT).st_dev not in shm.tmpfs_devices(),
    reason="no tmpfs at /dev/shm",
)

_names = itertools.count()


@contextlib.contextmanager
def shm_dir() -> Iterator[Path]:
    """A directory of its own in /dev/shm (tmpfs), removed with all in it."""
    path = Path(tempfile.mkdtemp(prefix="sluice-test-", dir=SHM_ROOT))
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
def root() -> Iterator[Path]:
    with shm_dir() as path:
        yield path


@pytest.fixture(params=[False, True], ids=["mapped", "copy"])
def copy(request: pytest.FixtureRequest) -> bool:
    """The registry's mode: copy=True maps no object."""
    return bool(request.param)


@pytest.fixture
def regions(root: Path, copy: bool) -> Iterator[Regions]:
    regions = Regions(root=root, require_tmpfs=True, copy=copy)
    yield regions
    regions.close()


def make(root: Path, size: int, fill: bytes = b"") -> str:
    """A new object of `size` bytes in `root` (zeros, or `fill` repeated); its key."""
    key = f"/obj-{next(_names)}"
    data = (fill * (size // len(fill) + 1))[:size] if fill else bytes(size)
    (root / key[1:]).write_bytes(data)
    return key


def contents(root: Path, key: str) -> bytes:
    fd = os.open(root / key[1:], os.O_RDONLY)
    try:
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def mapped(path: Path) -> bool:
    """Whether this process maps the object at `path` (unlinked ones too)."""
    text = Path("/proc/self/maps").read_text()
    return any(
        line.split(maxsplit=5)[5:] in ([f"{path}"], [f"{path} (deleted)"])
        for line in text.splitlines()
    )


def held(path: Path) -> bool:
    """Whether this process has the object at `path` open or mapped (unlinked ones too): a
    registry holds an fd to each region's object in both modes, and its mapping in one."""
    fds = Path("/proc/self/fd")
    links: list[str] = []
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            links.append(os.readlink(fds / fd))
    return mapped(path) or f"{path}" in links or f"{path} (deleted)" in links


def address(view: memoryview) -> int:
    """Where a view's bytes are in memory."""
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def error(fn: Callable[..., object], *args: object) -> SluiceError:
    with pytest.raises(SluiceError) as caught:
        fn(*args)
    return caught.value


def put(lease: shm.Lease, view: memoryview, data: bytes) -> None:
    """Write `data` at the start of an output view, as a call's writer does (marked)."""
    view[: len(data)] = data
    lease.wrote(view, len(data))


def test_register_status_and_unregister(root: Path, regions: Regions) -> None:
    a, b = make(root, 100), make(root, 3 * PAGE)
    regions.register("", "b", b, PAGE + 7, 2 * PAGE - 7)
    regions.register("", "a", a, 0, 100)
    assert len(regions) == 2
    assert regions.status("") == [
        RegionInfo("a", a, 0, 100),
        RegionInfo("b", b, PAGE + 7, 2 * PAGE - 7),
    ]
    assert regions.status("", "b") == [RegionInfo("b", b, PAGE + 7, 2 * PAGE - 7)]
    regions.unregister("", "a")
    assert [r.name for r in regions.status("")] == ["b"]
    regions.unregister("", "nobody registered this")  # no error, as in Triton
    regions.unregister("")
    assert regions.status("") == [] and len(regions) == 0
    assert not held(root / b[1:])


def test_the_default_root_is_dev_shm_and_must_be_tmpfs(copy: bool) -> None:
    regions = Regions(copy=copy)
    assert regions.root == SHM_ROOT and regions.require_tmpfs
    key = f"/sluice-test-{uuid.uuid4().hex}"
    path = SHM_ROOT / key[1:]
    path.write_bytes(b"abcdef")
    try:
        regions.register("", "x", key, 1, 4)
        with regions.lease("") as lease:
            assert bytes(lease.input("x", 0, 4)) == b"bcde"
    finally:
        regions.close()
        path.unlink()


@pytest.mark.parametrize("name", ["", "a" * 257, "a\x00b", "line\nbreak", "\x7f"])
def test_bad_names_are_refused(root: Path, regions: Regions, name: str) -> None:
    err = error(regions.register, "", name, make(root, 8), 0, 8)
    assert isinstance(err, InvalidInput)
    assert "must be 1-256 printable characters" in str(err)
    assert len(regions) == 0


def test_a_name_of_256_printable_characters_is_fine(root: Path, regions: Regions) -> None:
    name = "ü x/y" + "n" * 251
    regions.register("", name, make(root, 8), 0, 8)
    assert regions.status("", name)[0].name == name


@pytest.mark.parametrize(
    "key",
    [
        "",
        "/",
        "x",
        "../x",
        "/../x",
        "/etc/passwd",
        "/a/b",
        "//a",
        "/.",
        "/..",
        "/a\x00",
        "/a b",
        "/a\n",
        "/" + "a" * 251,
        "/ü",
    ],
)
def test_bad_keys_are_refused(regions: Regions, key: str) -> None:
    err = error(regions.register, "", "x", key, 0, 8)
    assert isinstance(err, InvalidInput)
    assert "must be a POSIX shared memory name: '/' then" in str(err)


@pytest.mark.parametrize("key", ["/" + "k" * 250, "/...", "/.a", "/A-z_0.9"])
def test_good_keys_are_taken(root: Path, regions: Regions, key: str) -> None:
    (root / key[1:]).write_bytes(bytes(8))
    regions.register("", "x", key, 0, 8)
    assert regions.status("", "x")[0].key == key


def test_a_missing_object_is_refused(regions: Regions) -> None:
    err = error(regions.register, "", "x", "/no-such-object", 0, 8)
    assert isinstance(err, InvalidInput)
    assert str(err) == "Unable to open shared memory region: '/no-such-object'"


def test_a_symlink_is_not_followed(root: Path, regions: Regions) -> None:
    target = make(root, 8)
    (root / "link").symlink_to(root / target[1:])
    err = error(regions.register, "", "x", "/link", 0, 8)
    assert isinstance(err, InvalidInput)
    assert str(err) == "shared memory key '/link' is not shared memory: a symbolic link"


def test_a_directory_or_fifo_is_refused(root: Path, regions: Regions) -> None:
    (root / "dir").mkdir()
    os.mkfifo(root / "fifo")
    for key in ("/dir", "/fifo"):
        err = error(regions.register, "", "x", key, 0, 1)
        assert isinstance(err, InvalidInput)
        assert f"shared memory key '{key}' is not shared memory" in str(err)
    assert len(regions) == 0


def test_a_hard_link_to_a_file_off_tmpfs_is_refused(tmp_path: Path, copy: bool) -> None:
    """Where /dev/shm is a plain directory on a disk, a hard link there reaches any file."""
    if os.stat(tmp_path).st_dev in shm.tmpfs_devices():
        pytest.skip("the temporary directory is on a tmpfs")
    root = tmp_path / "root"
    root.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for callers")
    os.link(secret, root / "link")
    regions = Regions(root=root, require_tmpfs=True, copy=copy)
    err = error(regions.register, "", "x", "/link", 0, 4)
    assert isinstance(err, InvalidInput)
    assert "shared memory key '/link' is not shared memory" in str(err)
    assert "is not a tmpfs" in str(err)
    # A test's root elsewhere takes it (the same filesystem as the root: no tmpfs asked).
    plain = Regions(root=root, copy=copy)
    plain.register("", "x", "/link", 0, 4)
    plain.close()


@pytest.mark.parametrize(
    ("offset", "byte_size", "says"),
    [
        (-1, 8, "offset must be 0 or more, got -1"),
        (0, 0, "byte size must be 1 or more, got 0"),
        (0, -8, "byte size must be 1 or more, got -8"),
        (1, 100, "offset 1 + byte size 100 is past the end"),
        (100, 1, "offset 100 + byte size 1 is past the end"),
        (2**64 - 1, 2**64 - 1, "past the end"),
        (0, 2**63, "past the end"),
    ],
)
def test_bad_offsets_and_sizes_are_refused(
    root: Path, copy: bool, offset: int, byte_size: int, says: str
) -> None:
    regions = Regions(root=root, max_bytes=2**70, copy=copy)
    key = make(root, 100)
    err = error(regions.register, "", "x", key, offset, byte_size)
    assert isinstance(err, InvalidInput)
    assert says in str(err)
    assert len(regions) == 0


def test_the_whole_object_and_its_last_byte_are_fine(root: Path, regions: Regions) -> None:
    key = make(root, 100, b"0123456789")
    regions.register("", "all", key, 0, 100)
    regions.register("", "last", key, 99, 1)
    with regions.lease("") as lease:
        assert bytes(lease.input("last", 0, 1)) == b"9"
        assert bytes(lease.input("all", 95, 5)) == b"56789"


@pytest.mark.parametrize("copy", [False], ids=["mapped"])
def test_a_region_that_cannot_be_mapped_is_resource_exhausted(
    root: Path, regions: Regions, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = make(root, 64)

    def no_room(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap, "mmap", no_room)
    err = error(regions.register, "", "x", key, 0, 64)
    monkeypatch.undo()
    assert status_of(err).name == "RESOURCE_EXHAUSTED"
    assert str(err) == (
        f"overloaded: unable to map shared memory region 'x' ('{key}', 64 bytes): Cannot "
        "allocate memory; unregister regions, or register a smaller one"
    )
    assert len(regions) == 0 and not held(root / key[1:])


def test_a_name_taken_is_refused(root: Path, regions: Regions) -> None:
    first = make(root, 8)
    regions.register("", "x", first, 0, 8)
    err = error(regions.register, "", "x", make(root, 16), 0, 16)
    assert isinstance(err, AlreadyExists)
    assert str(err) == "shared memory region 'x' already in manager"
    assert status_of(err).name == "ALREADY_EXISTS"
    assert regions.status("", "x") == [RegionInfo("x", first, 0, 8)]


def test_a_tenant_has_at_most_max_regions(root: Path, copy: bool) -> None:
    regions = Regions(root=root, max_regions=2, copy=copy)
    key = make(root, 8)
    regions.register("a", "1", key, 0, 8)
    regions.register("a", "2", key, 0, 8)
    err = error(regions.register, "a", "3", key, 0, 8)
    assert isinstance(err, QuotaExceeded)
    assert status_of(err).name == "RESOURCE_EXHAUSTED"
    assert str(err).startswith("quota: tenant a has 2 shared memory regions registered")
    assert "--shared-memory-regions 2" in str(err)
    regions.register("b", "1", make(root, 8), 0, 8)  # each tenant its own bound
    regions.unregister("a", "1")
    regions.register("a", "3", key, 0, 8)
    assert len(regions) == 3
    regions.close()


def test_a_tenant_has_at_most_max_bytes(root: Path, copy: bool) -> None:
    regions = Regions(root=root, max_bytes=100, copy=copy)
    key = make(root, 100)
    regions.register("", "60", key, 0, 60)
    err = error(regions.register, "", "41", key, 0, 41)
    assert isinstance(err, QuotaExceeded)
    assert "would bring the bytes callers have registered to 101" in str(err)
    assert "--shared-memory-bytes 100" in str(err)
    regions.register("", "40", key, 60, 40)  # exactly the bound
    regions.register("other", "100", make(root, 100), 0, 100)
    regions.close()


def test_status_of_an_unknown_name(regions: Regions) -> None:
    err = error(regions.status, "", "x")
    assert isinstance(err, RegionNotFound)
    assert str(err) == "Unable to find system shared memory region: 'x'"
    assert status_of(err).name == "NOT_FOUND"


def test_tenants_do_not_see_each_others_regions(root: Path, regions: Regions) -> None:
    def answers(tenant: str) -> tuple[str, str]:
        with regions.lease(tenant) as lease:
            return str(error(regions.status, tenant, "x")), str(error(lease.input, "x", 0, 1))

    never = answers("b")  # before anyone registered "x"
    a_key = make(root, 8, b"a")
    regions.register("a", "x", a_key, 0, 8)
    assert answers("b") == never  # no leak of a's region's existence
    assert regions.status("b") == []
    regions.unregister("b", "x")
    regions.unregister("b")
    assert regions.status("a") == [RegionInfo("x", a_key, 0, 8)]
    regions.register("b", "x", make(root, 4, b"b"), 0, 4)  # its own "x"
    with regions.lease("a") as a, regions.lease("b") as b:
        assert bytes(a.input("x", 0, 8)) == b"a" * 8
        assert bytes(b.input("x", 0, 4)) == b"b" * 4
    # Nor reach a's object under a name of their own, by its key or a link to it.
    os.link(root / a_key[1:], root / "alias")
    for key in (a_key, "/alias"):
        err = error(regions.register, "b", "y", key, 0, 8)
        assert str(err) == f"Unable to open shared memory region: '{key}'"
    regions.register("a", "y", "/alias", 0, 8)  # a itself may, twice
    regions.unregister("a")
    regions.register("b", "y", a_key, 0, 8)  # once a let go of it
    # Tenants off: "" is one more space, not all of them.
    assert regions.status("") == []
    assert len(regions) == 2
    assert [r.name for r in regions.status("b")] == ["x", "y"]


def test_views_read_and_write_the_object(root: Path, regions: Regions) -> None:
    key = make(root, 2 * PAGE, bytes(range(256)))
    regions.register("", "x", key, PAGE + 3, 100)
    lease = regions.lease("")
    view = lease.input("x", 10, 5)
    assert view.readonly and bytes(view) == bytes(range(13, 18))
    with pytest.raises(TypeError):
        view[0] = 1
    out = lease.output("x", 0, 6)
    # The object's bytes, or, copied, zeros: an output is written, not read.
    assert not out.readonly and bytes(out) == (bytes(6) if regions.copy else bytes(range(3, 9)))
    put(lease, out, b"WXYZ")
    written = contents(root, key)[PAGE + 3 : PAGE + 9]
    assert written == (bytes(range(3, 9)) if regions.copy else b"WXYZ\x07\x08")  # now, or later
    assert len(lease.input("x", 100, 0)) == 0  # an empty tensor at the end
    assert len(lease.output("x", 100, 0)) == 0
    del view, out
    lease.release()
    # Only the bytes written: the range's tail is the caller's as it was.
    assert contents(root, key)[PAGE + 3 : PAGE + 9] == b"WXYZ\x07\x08"


def test_lease_errors(root: Path, regions: Regions) -> None:
    regions.register("", "x", make(root, 64), 0, 16)
    with regions.lease("") as lease:
        err = error(lease.input, "nope", 0, 1)
        assert isinstance(err, InvalidInput)
        assert str(err) == "Unable to find shared memory region: 'nope'"
        for offset, byte_size in [(-1, 1), (0, -1), (0, 17), (16, 1), (2**64, 2**64), (8, 9)]:
            for use in (lease.input, lease.output):
                err = error(use, "x", offset, byte_size)
                assert isinstance(err, InvalidInput)
                assert str(err).startswith(
                    "Invalid offset + byte size for shared memory region: 'x'"
                )
        junk = "\x00" * 1000
        assert "..." in str(error(lease.input, junk, 0, 1))  # cut short, escaped
    err = error(lease.input, "x", 0, 1)
    assert "after its release" in str(err)


def test_a_truncated_object_gives_invalid_input(root: Path, regions: Regions) -> None:
    key = make(root, 3 * PAGE)
    regions.register("", "x", key, PAGE, 2 * PAGE)
    os.truncate(root / key[1:], PAGE + 100)
    with regions.lease("") as lease:
        assert len(lease.input("x", 0, 100)) == 100  # still inside what is left
        err = error(lease.input, "x", 0, PAGE)
        assert isinstance(err, InvalidInput)
        assert f"is {PAGE + 100} bytes now, short of the {2 * PAGE}" in str(err)
        if not regions.copy:  # copied, an output reads nothing: its write-back extends it
            err = error(lease.output, "x", 0, PAGE)
            assert f"is {PAGE + 100} bytes now, short of the {2 * PAGE}" in str(err)


def test_unregistering_under_a_live_lease_waits_for_its_release(
    root: Path, regions: Regions
) -> None:
    key = make(root, 64, b"live")
    path = root / key[1:]
    regions.register("", "x", key, 0, 64)
    lease = regions.lease("")
    view = lease.input("x", 0, 8)
    regions.unregister("", "x")
    assert len(regions) == 0
    assert isinstance(error(regions.status, "", "x"), RegionNotFound)
    with regions.lease("") as other:
        assert str(error(other.input, "x", 0, 1)) == "Unable to find shared memory region: 'x'"
    assert bytes(view) == b"livelive"  # still mapped (or read) under the running call
    assert held(path)
    del view
    lease.release()
    assert not held(path)
    lease.release()  # idempotent


@pytest.mark.parametrize("copy", [False], ids=["mapped"])
def test_a_view_kept_past_release_keeps_the_mapping_until_dropped(
    root: Path, regions: Regions
) -> None:
    key = make(root, 64, b"kept")
    path = root / key[1:]
    regions.register("", "x", key, 0, 64)
    with regions.lease("") as lease:
        array = np.frombuffer(lease.output("x", 0, 16), np.float32)
    regions.unregister("", "x")  # the mmap refuses to close: no error, no crash
    assert mapped(path)
    array[0] = 1.0  # still memory, not a fault
    del array
    gc.collect()
    assert not mapped(path)


@pytest.mark.parametrize("copy", [True], ids=["copy"])
def test_a_view_kept_past_release_is_never_handed_to_another_call(
    root: Path, regions: Regions
) -> None:
    """Copy mode: a buffer a caller's array still uses is left to it, not pooled."""
    key = make(root, 64, b"kept")
    regions.register("", "x", key, 0, 64)
    with regions.lease("") as lease:
        array = np.frombuffer(lease.output("x", 0, 16), np.uint8)
    array[:] = 1  # its own memory: no fault, and no longer the object's
    assert contents(root, key) == b"kept" * 16
    with regions.lease("") as other:
        view = other.input("x", 0, 16)
        assert bytes(view) == b"kept" * 4
        assert address(view) != array.ctypes.data
        del view
    assert bytes(array) == b"\x01" * 16


@pytest.mark.parametrize("copy", [True], ids=["copy"])
def test_copy_mode_maps_no_object(root: Path, regions: Regions) -> None:
    key = make(root, 3 * PAGE, b"xyz")
    path = root / key[1:]
    regions.register("", "x", key, PAGE + 5, PAGE)
    assert held(path) and not mapped(path)
    with regions.lease("") as lease:
        view = lease.input("x", 1, 600)
        out = lease.output("x", 700, 100)
        assert bytes(view) == contents(root, key)[PAGE + 6 : PAGE + 606]
        assert not mapped(path)
        assert address(view) % 64 == 0 and address(out) % 64 == 0  # as ONNX Runtime likes
        del view, out
    assert held(path) and not mapped(path)


@pytest.mark.parametrize("copy", [True], ids=["copy"])
def test_copy_mode_reuses_its_buffers(root: Path, regions: Regions) -> None:
    key = make(root, 3 * PAGE, b"abc")
    regions.register("", "x", key, 0, 3 * PAGE)
    seen: set[int] = set()
    for _ in range(3):  # a steady call: one buffer, its pages faulted once
        with regions.lease("") as lease:
            view = lease.input("x", 0, 2 * mmap.PAGESIZE + 1)
            seen.add(address(view))
            del view
    assert len(seen) == 1
    with regions.lease("") as lease:  # a near size (the same pages) shares it
        out = lease.output("x", 1, 3 * mmap.PAGESIZE - 1)
        assert address(out) in seen
        del out


@pytest.mark.parametrize("copy", [True], ids=["copy"])
def test_copy_mode_pools_a_bounded_number_of_buffers(
    root: Path, regions: Regions, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = mmap.PAGESIZE
    regions.register("", "x", make(root, 8 * size), 0, 8 * size)
    with regions.lease("") as lease:
        for _ in range(shm.POOL_PER_SIZE + 2):  # views dropped at once, buffers held
            lease.input("x", 0, size)
        lease.input("x", 0, 2 * size)
    assert {n: len(kept) for n, kept in regions._pool.items()} == {
        size: shm.POOL_PER_SIZE,
        2 * size: 1,
    }
    assert regions._pooled == (shm.POOL_PER_SIZE + 2) * size
    regions.close()
    assert not regions._pool and regions._pooled == 0
    monkeypatch.setattr(shm, "POOL_BYTES", 3 * size)
    regions.register("", "x", make(root, 8 * size), 0, 8 * size)
    with regions.lease("") as lease:
        for _ in range(3):
            lease.input("x", 0, size)
        lease.input("x", 0, 2 * size)  # past the bytes kept in all
    assert {n: len(kept) for n, kept in regions._pool.items()} == {size: 3}
    assert regions._pooled == 3 * size


def test_a_call_sees_only_its_own_object_through_a_reused_buffer(
    root: Path, regions: Regions
) -> None:
    """A buffer another call wrote (another tenant's) shows nothing of it, and an output a
    call leaves unwritten leaves the object as it was."""
    a, b = make(root, 4000, b"A"), make(root, 4000, b"b")
    regions.register("t1", "x", a, 0, 4000)
    regions.register("t2", "x", b, 0, 4000)
    with regions.lease("t1") as lease:
        out = lease.output("x", 0, 4000)
        put(lease, out, b"\xff" * 4000)
        first = address(out)
        del out
    with regions.lease("t2") as lease:
        out = lease.output("x", 0, 4000)
        assert bytes(out) == (bytes(4000) if regions.copy else b"b" * 4000)  # none of t1's
        assert address(out) == first or not regions.copy  # reused, in copy mode
        del out
        assert bytes(lease.input("x", 0, 4000)) == b"b" * 4000
    assert contents(root, a) == b"\xff" * 4000 and contents(root, b) == b"b" * 4000


def test_an_output_lands_though_its_region_was_unregistered(root: Path, regions: Regions) -> None:
    key = make(root, 64)
    regions.register("", "x", key, 0, 64)
    lease = regions.lease("")
    out = lease.output("x", 8, 8)
    regions.unregister("", "x")  # the call goes on, as it does with its mapping
    put(lease, out, b"finished")
    del out
    lease.release()
    assert contents(root, key) == bytes(8) + b"finished" + bytes(48)
    assert not held(root / key[1:])


def test_a_view_refused_leaves_no_claim(root: Path, regions: Regions) -> None:
    key = make(root, 2 * PAGE)
    regions.register("", "x", key, 0, 2 * PAGE)
    with regions.lease("") as warm:  # a buffer pooled, for the view refused to take
        warm.input("x", 0, 2 * PAGE)
    os.truncate(root / key[1:], PAGE)
    first = regions.lease("")
    assert isinstance(error(first.input, "x", 0, 2 * PAGE), InvalidInput)
    assert isinstance(error(first.output, "x", 0, 2 * PAGE + 1), InvalidInput)
    assert regions._pooled == (2 * PAGE if regions.copy else 0)  # nor keeps its buffer
    assert regions._copying == 0  # nor counts it
    os.truncate(root / key[1:], 2 * PAGE)
    with regions.lease("") as second:
        second.output("x", 0, 2 * PAGE)  # no RegionBusy: the refused view claimed nothing
    first.release()


@pytest.mark.parametrize("copy", [True], ids=["copy"])
def test_a_lease_released_during_a_copy_gives_no_view(
    root: Path, regions: Regions, monkeypatch: pytest.MonkeyPatch
) -> None:
    regions.register("", "x", make(root, 64), 0, 64)
    lease = regions.lease("")
    read = shm.read_in

    def released_meanwhile(copy: shm.Copy) -> None:
        lease.release()  # as another thread might, while this one reads
        read(copy)

    monkeypatch.setattr(shm, "read_in", released_meanwhile)
    assert "after its release" in str(error(lease.input, "x", 0, 64))
    assert regions._pooled == mmap.PAGESIZE  # its buffer back in the pool
    assert regions._copying == 0
    monkeypatch.undo()
    with regions.lease("") as other:
        other.output("x", 0, 64)  # the range is free


@pytest.mark.parametrize("copy", [True], ids=["copy"])
def test_no_memory_for_a_copy_is_an_error(
    root: Path, regions: Regions, monkeypatch: pytest.MonkeyPatch
) -> None:
    regions.register("", "x", make(root, 64), 0, 64)

    def no_memory(*args: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    with regions.lease("") as lease:
        monkeypatch.setattr(mmap, "mmap", no_memory)
        err = error(lease.output, "x", 0, 64)
        monkeypatch.undo()
        assert status_of(err).name == "RESOURCE_EXHAUSTED"
        assert str(err) == (
            "overloaded: shared memory region 'x': no memory for a copy of 64 bytes (Cannot "
            "allocate memory); retry later, or place smaller ranges"
        )
        assert regions._copying == 0
        with regions.lease("") as other:
            other.output("x", 0, 64)  # the refused view claimed nothing


def test_outputs_land_through_any_region_of_the_object(root: Path, regions: Regions) -> None:
    key = make(root, 200, b".")
    regions.register("", "a", key, 0, 100)
    regions.register("", "b", key, 50, 150)
    with regions.lease("") as lease:
        assert bytes(lease.input("b", 5, 20)) == b"." * 20
        put(lease, lease.output("a", 60, 10), b"0123456789")
        put(lease, lease.output("b", 20, 10), b"abcde")
    assert contents(root, key)[55:80] == b"....." + b"0123456789" + b"abcde" + b"....."


@pytest.mark.parametrize("copy", [True], ids=["copy"])
def test_a_failed_call_writes_nothing_back(root: Path, regions: Regions) -> None:
    """A call that failed, was cancelled or expired leaves the object as its caller left
    it: no output written back, no snapshot of the range over the caller's newer bytes."""
    key = make(root, 16, b"A")
    path = root / key[1:]
    regions.register("", "x", key, 0, 16)
    lease = regions.lease("")
    put(lease, lease.output("x", 0, 8), b"answered")
    path.write_bytes(b"NEWDATA!" * 2)  # the caller gave up on the call, and moved on
    lease.release(ok=False)
    assert contents(root, key) == b"NEWDATA!" * 2
    with pytest.raises(RuntimeError), regions.lease("") as failing:
        put(failing, failing.output("x", 0, 8), b"answered")
        raise RuntimeError("the call failed")  # a lease left by an error writes nothing
    assert contents(root, key) == b"NEWDATA!" * 2
    with regions.lease("") as unwritten:
        unwritten.output("x", 0, 16)  # never written: nothing goes back, even on success
        path.write_bytes(b"newer...newer...")
    assert contents(root, key) == b"newer...newer..."


@pytest.mark.parametrize("copy", [True], ids=["copy"])
def test_an_output_is_not_read(
    root: Path, regions: Regions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output's range costs no read (nor, fresh, resident memory) however large it is."""
    regions.register("", "x", make(root, 4 * PAGE), 0, 4 * PAGE)
    reads: list[int] = []
    preadv = os.preadv

    def counted(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads.append(offset)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    with regions.lease("") as lease:
        lease.output("x", 0, 4 * PAGE)
        assert reads == []
        lease.input("x", 0, 8)
        assert reads == [0]


def test_the_bytes_copied_in_flight_are_bounded(root: Path) -> None:
    regions = Regions(root=root, copy=True, max_copy_bytes=2 * PAGE)
    regions.register("", "x", make(root, 4 * PAGE), 0, 4 * PAGE)
    first = regions.lease("")
    first.input("x", 0, PAGE)
    first.output("x", PAGE, PAGE)
    with regions.lease("") as second:
        err = error(second.output, "x", 2 * PAGE, 1)
        assert status_of(err).name == "RESOURCE_EXHAUSTED" and err.reason == "quota"
        assert str(err) == (
            "quota: shared memory region 'x': a copy of 1 bytes would bring the bytes the "
            f"calls in flight copy to {2 * PAGE + 1}, over the most allowed ({2 * PAGE}, "
            "sluice.shm.registry.MAX_COPY_BYTES); retry when calls end, or place smaller ranges"
        )
        assert isinstance(error(second.input, "x", 0, 1), QuotaExceeded)
        first.release()
        second.output("x", 2 * PAGE, 2 * PAGE)  # the first call's bytes are free again
        err = error(second.input, "x", 0, 1)  # this call's own count too
        assert isinstance(err, QuotaExceeded)
    assert regions._copying == 0
    regions.close()


@pytest.mark.parametrize("copy", [True], ids=["copy"])
@pytest.mark.parametrize(
    ("errno_", "status"), [(errno.EIO, "INTERNAL"), (errno.ENOMEM, "RESOURCE_EXHAUSTED")]
)
def test_a_read_that_fails_is_the_calls_error(
    root: Path, regions: Regions, monkeypatch: pytest.MonkeyPatch, errno_: int, status: str
) -> None:
    key = make(root, 64)
    regions.register("", "x", key, 0, 64)

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno_, os.strerror(errno_))

    with regions.lease("") as lease:
        monkeypatch.setattr(os, "preadv", failing)
        err = error(lease.input, "x", 8, 16)
        monkeypatch.undo()
        assert status_of(err).name == status
        assert str(err).endswith(
            f"shared memory region 'x': the call's input of 16 bytes at offset 8 could not be "
            f"read from '{key}' (its first 0 were): {os.strerror(errno_)}"
        )
    assert regions._copying == 0


def test_only_an_output_view_of_the_lease_is_marked(root: Path, regions: Regions) -> None:
    regions.register("", "x", make(root, 64), 0, 64)
    with regions.lease("") as lease:
        out = lease.output("x", 0, 8)
        with pytest.raises(ValueError, match="9 bytes marked written in a view of 8"):
            lease.wrote(out, 9)
        if regions.copy:
            with pytest.raises(ValueError, match="not one of this lease's outputs"):
                lease.wrote(lease.input("x", 8, 8), 8)
            with pytest.raises(ValueError, match="not one of this lease's outputs"):
                lease.wrote(memoryview(bytearray(8)), 8)
        del out


def test_overlapping_writes_of_two_calls(root: Path, regions: Regions) -> None:
    regions.register("", "x", make(root, 100), 0, 100)
    first, second = regions.lease(""), regions.lease("")
    first.output("x", 10, 20)
    err = error(second.output, "x", 25, 10)
    assert isinstance(err, RegionBusy)
    assert status_of(err).name == "FAILED_PRECONDITION"
    assert str(err).startswith(
        "shared memory region 'x': bytes [25, 35) overlap bytes [10, 30) another call is writing"
    )
    second.output("x", 30, 10)  # adjacent is fine
    second.output("x", 0, 10)
    second.input("x", 0, 100)  # reading is always fine
    first.input("x", 10, 20)  # as is one call reading what it writes
    first.release()
    second.output("x", 10, 20)
    with regions.lease("") as third:
        assert isinstance(error(third.output, "x", 35, 1), RegionBusy)
        third.output("x", 40, 0)  # nothing written: nothing to collide
    second.release()
    with regions.lease("") as fourth:
        fourth.output("x", 0, 100)


def test_a_call_writes_no_bytes_twice_whatever_region_names_them(
    root: Path, regions: Regions
) -> None:
    """Two outputs of one call over each other would leave the caller one of them, unsaid:
    refused, as another call's are, through any region of the object."""
    key = make(root, 200)
    regions.register("", "a", key, 0, 100)
    regions.register("", "b", key, 50, 150)  # the same object, under a second name
    with regions.lease("") as lease:
        lease.output("a", 60, 10)
        err = error(lease.output, "a", 65, 10)
        assert isinstance(err, InvalidInput)
        assert str(err) == (
            "shared memory region 'a': bytes [65, 75) overlap bytes [60, 70) this call writes "
            "another output into; give each output its own bytes"
        )
        err = error(lease.output, "b", 15, 10)  # the object's bytes [65, 75) again
        assert isinstance(err, InvalidInput)
        assert str(err).startswith(
            "shared memory region 'b': bytes [15, 25) overlap bytes [60, 70) of region 'a' "
            "(the same object) this call writes another output into"
        )
        lease.output("b", 20, 10)  # adjacent: the object's [70, 80)
        with regions.lease("") as other:
            err = error(other.output, "b", 0, 11)
            assert isinstance(err, RegionBusy)
            assert str(err).startswith(
                "shared memory region 'b': bytes [0, 11) overlap bytes [60, 70) of region 'a' "
                "(the same object) another call is writing"
            )
            other.output("a", 0, 60)
    assert regions._writing == {}


def test_sweep_unregisters_unlinked_objects(root: Path, regions: Regions) -> None:
    kept, gone, leased = make(root, 8), make(root, 8, b"g"), make(root, 8, b"l")
    regions.register("", "kept", kept, 0, 8)
    regions.register("", "gone", gone, 0, 8)
    regions.register("t", "leased", leased, 0, 8)
    lease = regions.lease("t")
    view = lease.input("leased", 0, 8)
    assert regions.sweep() == []
    (root / gone[1:]).unlink()
    (root / leased[1:]).unlink()
    assert sorted(regions.sweep()) == ["gone", "leased"]
    assert [r.name for r in regions.status("")] == ["kept"] and regions.status("t") == []
    assert not held(root / gone[1:])
    assert bytes(view) == b"l" * 8 and held(root / leased[1:])
    del view
    lease.release()
    assert not held(root / leased[1:])
    assert regions.sweep() == []


def test_close_unregisters_everything(root: Path, regions: Regions) -> None:
    keys = [make(root, 8) for _ in range(3)]
    for i, key in enumerate(keys):
        regions.register(str(i), "x", key, 0, 8)
    lease = regions.lease("0")
    lease.input("x", 0, 8)
    regions.close()
    assert len(regions) == 0
    assert held(root / keys[0][1:]) and not held(root / keys[1][1:])
    lease.release()
    assert not held(root / keys[0][1:])


def test_a_lease_released_on_another_thread(root: Path, regions: Regions) -> None:
    key = make(root, 8)
    regions.register("", "x", key, 0, 8)
    lease = regions.lease("")
    lease.output("x", 0, 8)
    regions.unregister("", "x")
    thread = threading.Thread(target=lease.release)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert not held(root / key[1:])


def test_threads_register_lease_and_unregister_at_once(root: Path, copy: bool) -> None:
    regions = Regions(root=root, max_regions=1000, copy=copy)
    keys = [make(root, 64) for _ in range(4)]
    failures: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(50):
                name = f"{n}-{i % 3}"
                with contextlib.suppress(AlreadyExists):
                    regions.register("", name, keys[n], 0, 64)
                with regions.lease("") as lease:
                    put(lease, lease.output(name, 0, 64), bytes([n]) * 64)
                regions.unregister("", name)
        except BaseException as exc:  # handed to the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures and not any(t.is_alive() for t in threads)
    assert len(regions) == 0
    for n, key in enumerate(keys):
        assert contents(root, key) == bytes([n]) * 64


# Any integer a request's field may carry, and those near a region's bounds.
ranges = st.one_of(
    st.integers(-4, 3 * PAGE),
    st.integers(-(2**65), 2**65),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63)]),
)


@pytest.mark.parametrize("copy", [False, True], ids=["mapped", "copy"])
@settings(max_examples=200, deadline=None)
@given(
    region_offset=st.integers(0, 2 * PAGE + 1),
    region_size=st.integers(1, 2 * PAGE + 1),
    slack=st.integers(0, 9),
    data=st.data(),
)
def test_views_lie_inside_the_region(
    copy: bool, region_offset: int, region_size: int, slack: int, data: st.DataObject
) -> None:
    offset = data.draw(st.one_of(st.integers(0, region_size), ranges), "offset")
    room = region_size - offset if 0 <= offset <= region_size else 0
    byte_size = data.draw(st.one_of(st.integers(0, room), ranges), "byte_size")
    size = region_offset + region_size + slack
    with shm_dir() as root:
        key = make(root, size)
        regions = Regions(root=root, copy=copy)
        regions.register("", "r", key, region_offset, region_size)
        expected = bytes(size)
        with regions.lease("") as lease:
            try:
                out = lease.output("r", offset, byte_size)
            except InvalidInput:
                event("refused")
                assert not (offset >= 0 and byte_size >= 0 and offset + byte_size <= region_size)
                with pytest.raises(InvalidInput):
                    lease.input("r", offset, byte_size)
            else:
                event("a view")
                assert len(out) == byte_size
                put(lease, out, b"\xab" * byte_size)
                del out
                at = region_offset + offset
                expected = bytes(at) + b"\xab" * byte_size + bytes(size - at - byte_size)
        assert contents(root, key) == expected  # with os.pread, after the release
        regions.close()


# A child that takes views of an object, waits while the test truncates the object to 0, then
# reads every byte of its input view, writes its output view and takes one more input view.
TRUNCATED = """
import sys
from pathlib import Path
from sluice.core.errors import InvalidInput
from sluice.shm.registry import Regions

root, key, mode, page = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
regions = Regions(root=root, require_tmpfs=True, copy=mode == "copy")
regions.register("", "x", key, page, 2 * page)
lease = regions.lease("")
view = lease.input("x", 0, page)
out = lease.output("x", page, page)
print("ready", flush=True)
sys.stdin.readline()
print(sum(view), flush=True)
out[:] = b"\\x07" * page
lease.wrote(out, page)
try:
    lease.input("x", 0, page)
except InvalidInput as exc:
    print(exc, flush=True)
lease.release()
regions.close()
"""


def truncated_under(root: Path, key: str, mode: str) -> subprocess.CompletedProcess[str]:
    """TRUNCATED run in `mode`, the object `key` truncated to 0 under its views."""
    args = [sys.executable, "-c", TRUNCATED, str(root), key, mode, str(PAGE)]
    child = subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        # A child that hangs before it says so fails the test rather than holding it.
        waited, _, _ = select.select([child.stdout], [], [], 60)
        ready = child.stdout.readline() if waited else ""

        if ready == "ready\n":
            fd = os.open(root / key[1:], os.O_RDWR)
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)
        out, err = child.communicate("go\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert ready == "ready\n", err
    return subprocess.CompletedProcess(args, child.returncode, out, err)


def test_a_caller_truncating_its_object_cannot_crash_copy_mode(root: Path) -> None:
    key = make(root, 3 * PAGE, b"\x01")
    done = truncated_under(root, key, "copy")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        str(PAGE),  # every byte read: the ones the view held when taken
        f"shared memory region 'x': its object '{key}' is 0 bytes now, short of the "
        f"{2 * PAGE} this call uses (truncated since it was registered)",
    ]
    # The output went where it was bound: the caller's object grew back to hold it.
    assert contents(root, key) == bytes(2 * PAGE) + b"\x07" * PAGE


def test_a_caller_truncating_its_object_crashes_mapped_mode(root: Path) -> None:
    """Why copy mode exists: the mapped server takes SIGBUS reading what was truncated."""
    done = truncated_under(root, make(root, 3 * PAGE, b"\x01"), "mapped")
    assert done.returncode == -signal.SIGBUS, done.stderr
    assert done.stdout == ""


# A child that cannot write past `page` + 100 in any file: its output's write-back fails.
UNWRITABLE = """
import resource, signal, sys
from pathlib import Path
from sluice.core.errors import SluiceError
from sluice.shm.registry import Regions

root, key, page = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
regions = Regions(root=root, require_tmpfs=True, copy=True)
regions.register("", "x", key, page, page)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a signal, past the limit
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (page + 100, hard))
lease = regions.lease("")
out = lease.output("x", 0, page)
out[:] = b"\\x07" * page
lease.wrote(out, page)
try:
    lease.release()
except SluiceError as exc:
    print(exc.status, exc, flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
with regions.lease("") as again:  # the range is free again: that lease was let go
    out = again.output("x", 0, page)
    out[:] = b"\\x08" * page
    again.wrote(out, page)
regions.close()
"""


def test_an_output_that_cannot_be_written_fails_the_release(root: Path) -> None:
    key = make(root, 2 * PAGE)
    done = subprocess.run(
        [sys.executable, "-c", UNWRITABLE, str(root), key, str(PAGE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"INTERNAL shared memory region 'x': the call's output of {PAGE} bytes at offset 0 "
        f"could not be written to '{key}' (its first 100 were): File too large"
    ]
    assert contents(root, key) == bytes(PAGE) + b"\x08" * PAGE
