"""The API's tensor datatypes (KServe v2 names) and their numpy dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sluice.core.errors import TensorError


@dataclass(frozen=True)
class DataType:
    name: str
    dtype: np.dtype[np.generic]  # little-endian, as on the wire
    typed_field: str  # the Tensor field that carries the values when not raw


DATATYPES: dict[str, DataType] = {
    d.name: d
    for d in (
        DataType("BOOL", np.dtype("bool"), "bool_data"),
        DataType("UINT8", np.dtype("uint8"), "uint_data"),
        DataType("UINT16", np.dtype("<u2"), "uint_data"),
        DataType("UINT32", np.dtype("<u4"), "uint_data"),
        DataType("UINT64", np.dtype("<u8"), "uint64_data"),
        DataType("INT8", np.dtype("int8"), "int_data"),
        DataType("INT16", np.dtype("<i2"), "int_data"),
        DataType("INT32", np.dtype("<i4"), "int_data"),
        DataType("INT64", np.dtype("<i8"), "int64_data"),
        DataType("FP16", np.dtype("<f2"), "fp32_data"),
        DataType("FP32", np.dtype("<f4"), "fp32_data"),
        DataType("FP64", np.dtype("<f8"), "fp64_data"),
    )
}
# By numpy kind and item size: either byte order.
BY_KIND = {(d.dtype.kind, d.dtype.itemsize): d for d in DATATYPES.values()}


def datatype_of(dtype: np.dtype[np.generic]) -> DataType:
    """The API datatype for a numpy dtype, or TensorError if the API has none."""
    found = BY_KIND.get((dtype.kind, dtype.itemsize))  # on every output: no other call
    if found is None:
        supported = ", ".join(DATATYPES)
        raise TensorError(f"numpy dtype {dtype} has no API datatype (supported: {supported})")
    return found


def name_of(dtype: np.dtype[np.generic]) -> str:
    """The API name for a numpy dtype, or numpy's own name when the API has none."""
    found = BY_KIND.get((dtype.kind, dtype.itemsize))
    return found.name if found else str(dtype)


def bytes_of(array: np.ndarray) -> memoryview:
    """`array`'s bytes as the API carries them (little-endian, row-major), flat; a view of
    them where they are so already."""
    dt = datatype_of(array.dtype)
    return np.ascontiguousarray(array, dtype=dt.dtype).reshape(-1).view(np.uint8).data
