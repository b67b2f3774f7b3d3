"""Staging buffers: host arrays kept in a pool by (dtype, row shape, rows bucket) and reused,
so a batch is assembled by copying each request's bytes straight into place. On CUDA the
allocator hands out pinned (page-locked) host memory, which the GPU copies asynchronously.
Transport-free."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Allocates `nbytes` of host memory as a uint8 array (that keeps its memory alive).
Allocator = Callable[[int], np.ndarray]


def numpy_allocator(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def bucket(rows: int) -> int:
    """Rows rounded up to a power of two: few sizes, at most 2x the memory."""
    return 1 << max(rows - 1, 0).bit_length()


@dataclass(frozen=True)
class PoolStats:
    buffers: int  # resting in the pool
    bytes: int  # resting in the pool
    reused: int
    allocated: int
    dropped: int  # returned when the pool was full or the buffer too large, and freed


Key = tuple[str, tuple[int, ...], int]


# The largest buffer the pool keeps, as a share of its budget (16 MiB of the default 256 MiB).
# Larger ones are freed on return: one rare large batch (a 25 MB request, staged on CUDA, takes
# a 32 MiB pinned buffer and 6 MiB more for its outputs) would otherwise hold its memory for
# good, and the budget the common sizes need.
LARGEST_SHARE = 16


class BufferPool:
    """Thread-safe: buffers are taken on the event loop and may be returned from a runner.
    Keeps at most `max_bytes`, none larger than `max_bytes // LARGEST_SHARE`."""

    def __init__(
        self,
        max_bytes: int = 256 << 20,
        allocate: Allocator = numpy_allocator,
        keep_bytes: int = 0,
    ) -> None:
        self.max_bytes = max_bytes
        # `keep_bytes`: buffers this large are kept too (up to half the budget): a full
        # batch's, which would otherwise be allocated anew for every full batch.
        self.max_buffer_bytes = max(max_bytes // LARGEST_SHARE, min(keep_bytes, max_bytes // 2))
        self._allocate = allocate
        self._free: defaultdict[Key, list[np.ndarray]] = defaultdict(list)
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0
        self.dropped = 0

    def take(
        self, dtype: np.dtype[np.generic], row_shape: tuple[int, ...], rows: int
    ) -> np.ndarray:
        """A buffer of at least `rows` rows; the caller slices `[:rows]` and must `give` it back."""
        key: Key = (dtype.str, row_shape, bucket(rows))
        with self._lock:
            free = self._free.get(key)
            if free:
                buffer = free.pop()
                self._bytes -= buffer.nbytes
                self.reused += 1
                return buffer
            self.allocated += 1
        shape = (key[2], *row_shape)
        count = int(np.prod(shape))
        raw = self._allocate(count * dtype.itemsize)
        return raw[: count * dtype.itemsize].view(dtype).reshape(shape)

    def give(self, buffer: np.ndarray) -> None:
        key: Key = (buffer.dtype.str, tuple(buffer.shape[1:]), buffer.shape[0])
        with self._lock:
            if (
                buffer.nbytes > self.max_buffer_bytes
                or self._bytes + buffer.nbytes > self.max_bytes
            ):
                self.dropped += 1
                return
            self._free[key].append(buffer)
            self._bytes += buffer.nbytes

    def stats(self) -> PoolStats:
        with self._lock:
            count = sum(len(v) for v in self._free.values())
            return PoolStats(count, self._bytes, self.reused, self.allocated, self.dropped)
