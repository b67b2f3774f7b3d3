"""CUDA helpers through CuPy (optional: `pip install 'sluice[gpu]'`): pinned host memory for
staging buffers and one CUDA stream per model instance. Without CuPy the engine still runs
on CUDA, with pageable staging memory and ONNX Runtime's own stream per session."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("sluice.gpu")


def _cupy() -> Any | None:
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def pinned_allocator() -> Any | None:
    """An allocator of page-locked host memory as uint8 arrays, or None without CuPy."""
    cupy = _cupy()
    if cupy is None:
        return None

    def allocate(nbytes: int) -> np.ndarray:
        memory = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        # The array's base keeps the pinned block alive for as long as any view of it.
        return np.frombuffer(memory, dtype=np.uint8, count=nbytes)

    return allocate


def new_stream() -> tuple[Any, int] | None:
    """A non-blocking CUDA stream and its handle, or None without CuPy."""
    cupy = _cupy()
    if cupy is None:
        return None
    stream = cupy.cuda.Stream(non_blocking=True)
    return stream, int(stream.ptr)
