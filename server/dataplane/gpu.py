"""CUDA for the engine: GPU presence, the CUDA libraries ONNX Runtime lacks, and through CuPy
(optional) pinned host memory and a CUDA stream per instance."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from typing import Any

import numpy as np
import onnxruntime as ort

log = logging.getLogger("sluice.gpu")

# What the CUDA provider loads, by the CUDA major onnxruntime-gpu was built for.
LIBRARIES = {
    "12": ("libcudart.so.12", "libcublasLt.so.12", "libcublas.so.12", "libcurand.so.10",
           "libcufft.so.11", "libcudnn.so.9"),
    "13": ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13", "libcurand.so.10",
           "libcufft.so.12", "libcudnn.so.9"),
}  # fmt: skip


def device_count() -> int:
    """GPUs the CUDA driver can see, without touching ONNX Runtime (so no log noise)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def cuda_major() -> str:
    """The CUDA major this onnxruntime build was made for ("" for a CPU build)."""
    try:
        from onnxruntime.capi import build_and_package_info as info
    except ImportError:
        return ""
    return str(getattr(info, "cuda_version", "") or "").split(".")[0]


@functools.cache
def missing_libraries() -> tuple[str, ...]:
    """Load the CUDA and cuDNN libraries the CUDA provider needs (pip's nvidia-* packages,
    else the system's); those that would not load. Once per process."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        with contextlib.suppress(Exception):
            preload()
    missing = []
    for name in LIBRARIES.get(cuda_major(), ()):
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return tuple(missing)


@functools.cache
def _cupy() -> Any | None:
    """CuPy with a working CUDA runtime, or None (logged: why not)."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()  # a broken runtime fails here, not at import
    except ImportError:
        return None
    except Exception as exc:
        log.warning("CuPy cannot start (%s): pageable staging memory, ORT's own streams", exc)
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


def is_pinned(array: np.ndarray) -> bool:
    """Whether the CUDA runtime knows `array`'s memory as page-locked host memory."""
    cupy = _cupy()
    if cupy is None:
        return False
    try:
        attributes = cupy.cuda.runtime.pointerGetAttributes(array.ctypes.data)
    except Exception:
        return False
    return int(attributes.type) == 1  # cudaMemoryTypeHost
