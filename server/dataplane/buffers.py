"""Staging buffers pooled by (dtype, row shape, rows bucket), on CUDA pinned host memory."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# `nbytes` of host memory as a uint8 array that keeps its memory alive.
Allocator = Callable[[int], np.ndarray]


def numpy_allocator(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def bucket(rows: int) -> int:
    """Rows rounded up to a power of two: few sizes, at most 2x the memory."""
    return 1 << max(rows - 1, 0).bit_length()


@dataclass(frozen=True)
class PoolStats:
    buffers: int  # resting in the pool
    bytes: int
    reused: int
    allocated: int
    dropped: int  # freed on return: the pool full or the buffer too large


Key = tuple[str, tuple[int, ...], int]


# The largest buffer kept, as a share of the budget: one rare 25 MB request would otherwise
# hold 38 MiB of pinned memory for good.
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
        # `keep_bytes`: a full batch's buffers are kept too (up to half the budget).
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
