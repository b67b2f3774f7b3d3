"""The tensor codec: exact round trips for every datatype, clear errors for bad tensors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sluice.core.datatypes import DATATYPES
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

DTYPES = [d.dtype.newbyteorder("=") for d in DATATYPES.values()]


@given(
    array=st.sampled_from(DTYPES).flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    ),
    typed=st.booleans(),
)
def test_round_trip_is_exact(array: np.ndarray, typed: bool) -> None:
    message = codec.encode("x", array, typed=typed)
    back = codec.decode(pb.Tensor.FromString(message.SerializeToString()))
    assert back.dtype == array.dtype
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    if array.dtype.kind == "f":  # NaN payloads and signed zeros survive too
        assert back.tobytes() == array.tobytes() or typed


def test_raw_bytes_are_little_endian() -> None:
    message = codec.encode("x", np.array([1], dtype=">i4"))
    assert message.raw_data == b"\x01\x00\x00\x00"
    assert message.datatype == "INT32"


def test_unsupported_numpy_dtype() -> None:
    with pytest.raises(codec.TensorError, match="has no API datatype"):
        codec.encode("x", np.array(["a"]))


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (pb.Tensor(name="x", datatype="FP32", shape=[2], raw_data=b"\0" * 7), "needs 8"),
        (pb.Tensor(name="x", datatype="INT8", shape=[2], int_data=[1, 300]), "outside the range"),
        (pb.Tensor(name="x", datatype="UINT8", shape=[1], uint_data=[256]), "outside the range"),
        (pb.Tensor(name="x", datatype="BF16", shape=[1], raw_data=b"\0\0"), "unknown datatype"),
        (pb.Tensor(name="x", datatype="FP32", shape=[1], fp64_data=[1.0]), "go in fp32_data"),
        (
            pb.Tensor(name="x", datatype="FP32", shape=[1], fp32_data=[1], fp64_data=[1]),
            "several typed fields",
        ),
        (pb.Tensor(datatype="FP32", shape=[1], raw_data=b"\0" * 3), "a tensor with no name"),
        (
            pb.Tensor(name="x", datatype="FP32", shape=[1], raw_data=b"\0" * 4, fp32_data=[0]),
            "both raw_data and fp32_data",
        ),
        (pb.Tensor(name="x", datatype="FP32", shape=[2], fp32_data=[1.0]), "has 1 values"),
        (pb.Tensor(name="x", datatype="FP32", shape=[-1, 2], raw_data=b""), "negative dimension"),
        (pb.Tensor(name="x", datatype="FP32", shape=[1] * 65, raw_data=b"\0" * 4), "at most 64"),
        (pb.Tensor(name="x", datatype="FP32", shape=[0] * 65), "65 dimensions"),
        (pb.Tensor(name="x", datatype="FP32", shape=[0, 2**62, 2**62]), "elements"),
        (pb.Tensor(name="x", datatype="INT8", shape=[2**63 - 1, 2]), "elements"),
        (pb.Tensor(name="x", datatype="BOOL", shape=[3], raw_data=b"\0\1\2"), "other than 0 and 1"),
        (pb.Tensor(name="x", datatype="FP16", shape=[1], fp32_data=[70000.0]), "range of FP16"),
    ],
)
def test_decode_errors_name_the_fault(tensor: pb.Tensor, message: str) -> None:
    with pytest.raises(codec.TensorError, match=message):
        codec.decode(tensor)


def test_empty_tensor_decodes_with_no_data() -> None:
    array = codec.decode(pb.Tensor(name="x", datatype="FP32", shape=[0, 64]))
    assert array.shape == (0, 64)


def test_the_deepest_shape_numpy_allows_decodes() -> None:
    array = codec.decode(pb.Tensor(name="x", datatype="FP32", shape=[1] * 64, raw_data=b"\0" * 4))
    assert array.ndim == 64


def test_bool_raw_bytes_of_0_and_1_decode() -> None:
    array = codec.decode(pb.Tensor(name="x", datatype="BOOL", shape=[2], raw_data=b"\1\0"))
    assert array.tolist() == [True, False]


def test_a_repeated_name_is_refused() -> None:
    x = codec.encode("x", np.zeros((1, 2), np.float32))
    with pytest.raises(codec.TensorError, match="appears more than once"):
        codec.decode_all([x, x])


# Arrays as models hand them out: native or big-endian, contiguous or not, scalars, empty.
def _any_array(dt: np.dtype[np.generic]) -> st.SearchStrategy[np.ndarray]:
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
    plain = hnp.arrays(dt, shapes)
    return st.one_of(
        plain,
        plain.map(lambda a: a.astype(a.dtype.newbyteorder(">"))),
        plain.map(lambda a: a.T),  # strided
    )


@given(
    outputs=st.dictionaries(
        st.text(max_size=3), st.sampled_from(DTYPES).flatmap(_any_array), max_size=3
    ),
    model=st.text(max_size=5),
    version=st.sampled_from(["", "1", "2024-01"]),
    typed=st.booleans(),
)
def test_the_written_response_is_the_one_protobuf_writes(
    outputs: dict[str, np.ndarray], model: str, version: str, typed: bool
) -> None:
    want = pb.PredictResponse(
        model=model, version=version, outputs=codec.encode_all(outputs, typed=typed)
    ).SerializeToString()
    assert codec.encode_predict_response(model, version, outputs, typed) == want


def test_a_large_output_is_copied_once_into_the_response() -> None:
    """In a process whose every large block is a fresh mapping, the faults an encode takes
    count the blocks it fills: one, the response itself (the tensor's bytes, then the
    message, then its serialization were 7 blocks' worth). Python's own allocations too."""
    script = """
import ctypes, resource, tracemalloc
import numpy as np
assert ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD, fixed
from sluice.wire import codec
x = np.random.default_rng(0).random((1, 3, 224, 224), np.float32)  # 602 KB
for _ in range(3):
    codec.encode_predict_response("m", "1", {"output": x}, False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    codec.encode_predict_response("m", "1", {"output": x}, False)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50
tracemalloc.start()
codec.encode_predict_response("m", "1", {"output": x}, False)
print(faults / (x.nbytes / 4096), tracemalloc.get_traced_memory()[1] / x.nbytes)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    blocks, peak = map(float, done.stdout.split())
    assert blocks < 1.5
    assert peak < 1.01
