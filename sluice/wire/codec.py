"""Tensor codec for the sluice.v1 API: numpy arrays to `Tensor` messages and back.

Shared by the server and the client so that both sides agree on datatype names,
byte order and the typed fields. Decoding checks the message against itself
(known datatype, sane shape, element count); checking against a model is the
server's job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from sluice.core.datatypes import DATATYPES, DataType
from sluice.core.datatypes import datatype_of as _datatype_of
from sluice.v1 import inference_pb2 as pb


class TensorError(ValueError):
    """A tensor message that cannot be decoded; the message says why."""


MAX_RANK = 64  # numpy's own limit (NPY_MAXDIMS)
# The most elements a shape may describe, counting its non-zero dimensions only (numpy
# refuses even an empty array whose other dimensions overflow its sizes); far beyond any
# message gRPC lets through, and far within numpy's byte count.
MAX_ELEMENTS = 2**48


_TYPED_FIELDS = sorted({d.typed_field for d in DATATYPES.values()})


def datatype_of(dtype: np.dtype[np.generic]) -> DataType:
    """The API datatype for a numpy dtype, or TensorError if the API has none."""
    found = _datatype_of(dtype)
    if found is None:
        supported = ", ".join(DATATYPES)
        raise TensorError(f"numpy dtype {dtype} has no API datatype (supported: {supported})")
    return found


def encode(name: str, array: np.ndarray, *, typed: bool = False) -> pb.Tensor:
    """A Tensor message for `array`: raw little-endian bytes, or the typed field."""
    dt = datatype_of(array.dtype)
    tensor = pb.Tensor(name=name, datatype=dt.name, shape=array.shape)
    if typed:
        getattr(tensor, dt.typed_field).extend(array.reshape(-1).tolist())
    else:
        tensor.raw_data = np.ascontiguousarray(array, dtype=dt.dtype).tobytes()
    return tensor


def encode_all(arrays: Mapping[str, np.ndarray], *, typed: bool = False) -> list[pb.Tensor]:
    return [encode(name, array, typed=typed) for name, array in arrays.items()]


def decode(tensor: pb.Tensor) -> np.ndarray:
    """The array a Tensor message carries; TensorError names the tensor and the fault."""
    label = f"tensor {tensor.name!r}" if tensor.name else "a tensor with no name"
    dt = DATATYPES.get(tensor.datatype)
    if dt is None:
        raise TensorError(
            f"{label} has unknown datatype {tensor.datatype!r}; "
            f"expected one of {', '.join(DATATYPES)}"
        )
    shape = tuple(tensor.shape)
    if len(shape) > MAX_RANK:
        raise TensorError(f"{label} has {len(shape)} dimensions; at most {MAX_RANK} are allowed")
    if any(d < 0 for d in shape):
        raise TensorError(f"{label} has a negative dimension in shape {list(shape)}")
    count = math.prod(shape)
    # An empty shape is judged by its other dimensions (only those pay for a generator).
    if count > MAX_ELEMENTS or (not count and math.prod(d for d in shape if d) > MAX_ELEMENTS):
        raise TensorError(
            f"{label} has shape {list(shape)}, over {MAX_ELEMENTS} elements; "
            "no message can carry it"
        )
    present = [f for f in _TYPED_FIELDS if len(getattr(tensor, f))]
    if tensor.raw_data and present:
        raise TensorError(
            f"{label} carries both raw_data and {present[0]}; send exactly one of them"
        )
    if len(present) > 1:
        raise TensorError(f"{label} fills several typed fields ({', '.join(present)}); use one")
    if present and present[0] != dt.typed_field:
        raise TensorError(
            f"{label} is {dt.name} but fills {present[0]}; {dt.name} values go in {dt.typed_field}"
        )
    if present:
        values = getattr(tensor, dt.typed_field)
        if len(values) != count:
            raise TensorError(
                f"{label} has {len(values)} values in {dt.typed_field} "
                f"but shape {list(shape)} needs {count}"
            )
        return typed_array(values, dt, label).reshape(shape)
    expected = count * dt.dtype.itemsize
    if len(tensor.raw_data) != expected:
        raise TensorError(
            f"{label} has {len(tensor.raw_data)} bytes of raw_data but {dt.name} "
            f"shape {list(shape)} needs {expected} ({count} x {dt.dtype.itemsize} bytes)"
        )
    array = np.frombuffer(tensor.raw_data, dtype=dt.dtype)
    if dt.dtype.kind == "b" and array.view(np.uint8).max(initial=0) > 1:
        raise TensorError(f"{label} is BOOL but its raw_data holds bytes other than 0 and 1")
    return array.reshape(shape)


def typed_array(values: Iterable[object], dt: DataType, label: str) -> np.ndarray:
    array = np.asarray(values, dtype=_WIDE[dt.typed_field])
    if dt.dtype.kind in "iu":
        info = np.iinfo(dt.dtype)  # type: ignore[type-var]  # integer kinds only, checked above
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise TensorError(f"{label} has values outside the range of {dt.name}")
    elif dt.dtype.kind == "f" and dt.dtype.itemsize < array.dtype.itemsize:
        # NaN and infinity are values too; a finite value the narrower type cannot hold
        # would turn into infinity.
        largest = float(np.finfo(dt.dtype).max)  # type: ignore[type-var]  # float kinds only
        if (np.isfinite(array) & (np.abs(array) > largest)).any():
            raise TensorError(f"{label} has finite values outside the range of {dt.name}")
    return array.astype(dt.dtype.newbyteorder("="))


_WIDE = {
    "bool_data": np.dtype("bool"),
    "int_data": np.dtype("int64"),
    "int64_data": np.dtype("int64"),
    "uint_data": np.dtype("uint64"),
    "uint64_data": np.dtype("uint64"),
    "fp32_data": np.dtype("float32"),
    "fp64_data": np.dtype("float64"),
}


def decode_all(tensors: Iterable[pb.Tensor]) -> dict[str, np.ndarray]:
    """Decode tensors by name; TensorError on a fault or a repeated name."""
    arrays: dict[str, np.ndarray] = {}
    for tensor in tensors:
        if tensor.name in arrays:
            raise TensorError(f"tensor {tensor.name!r} appears more than once")
        arrays[tensor.name] = decode(tensor)
    return arrays
