"""Plain Python values as tensors: nested lists, tuples and scalars are converted to the
input's declared datatype (or a stated default without one); what cannot be converted is a
TypeError naming the input and the datatype wanted; numpy arrays pass untouched."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from sluice.client import SluiceClient
from sluice.core.datatypes import DATATYPES
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec


def sent(value: object, datatype: str = "") -> np.ndarray:
    """What the other side decodes from `value` encoded as input `x`."""
    message = codec.encode("x", value, datatype=datatype)
    return codec.decode(pb.Tensor.FromString(message.SerializeToString()))


@pytest.mark.parametrize(
    ("value", "datatype", "want"),
    [
        ([[0, 1, 2], [3, 4, 5]], "FP32", np.array([[0, 1, 2], [3, 4, 5]], np.float32)),
        (((1.5, 2.0), (3.0, 4.0)), "FP64", np.array([[1.5, 2], [3, 4]], np.float64)),
        ([[1, 2]], "INT64", np.array([[1, 2]], np.int64)),
        ([255, 0], "UINT8", np.array([255, 0], np.uint8)),
        ([-128, 127], "INT8", np.array([-128, 127], np.int8)),
        ([2.0, -3.0], "INT32", np.array([2, -3], np.int32)),  # whole numbers as floats
        ([True, False], "BOOL", np.array([True, False])),
        ([1, 0], "BOOL", np.array([True, False])),
        ([0.5, 1], "FP16", np.array([0.5, 1], np.float16)),
        ([True, 2], "FP32", np.array([1, 2], np.float32)),
        (3, "FP32", np.array(3, np.float32)),
        (np.int64(7), "FP32", np.array(7, np.float32)),  # a numpy scalar: the declared type
        ([np.float64(0.25)], "FP32", np.array([0.25], np.float32)),
        ([], "FP32", np.zeros(0, np.float32)),
    ],
)
def test_plain_values_take_the_declared_datatype(
    value: object, datatype: str, want: np.ndarray
) -> None:
    got = sent(value, datatype)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ([[0.5, 1.0]], np.array([[0.5, 1.0]], np.float32)),  # most models take FP32
        ([[0.5, 1]], np.array([[0.5, 1.0]], np.float32)),
        ([[1, 2]], np.array([[1, 2]], np.int64)),
        ([True, False], np.array([True, False])),
        (2.5, np.array(2.5, np.float32)),
        (np.float64(2.5), np.array(2.5, np.float64)),  # a numpy scalar keeps its own type
        (np.uint16(9), np.array(9, np.uint16)),
    ],
)
def test_without_a_declared_datatype_the_default_rule(value: object, want: np.ndarray) -> None:
    got = sent(value)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("value", "datatype", "reason"),
    [
        ([[1, 2], [3]], "FP32", "differ in length"),
        ([["a", "b"]], "FP32", "strings"),
        (["1.5"], "FP64", "strings"),  # numpy would parse it: a string is still not a number
        (None, "FP32", "None"),
        ([1, None], "INT64", "None"),
        ([1 + 2j], "FP64", "complex"),
        ({"a": 1}, "FP32", "not numbers"),
        ([1.5], "INT64", "not whole numbers"),
        ([float("nan")], "INT32", "not whole numbers"),
        ([300], "UINT8", "outside the range of UINT8"),
        ([-1], "UINT32", "outside the range of UINT32"),
        ([2**70], "INT64", "beyond 64 bits"),
        ([2**63], "INT64", "outside the range of INT64"),
        ([1e300], "FP32", "outside the range of FP32"),
        ([70000], "FP16", "outside the range of FP16"),
        ([2], "BOOL", "only true, false, 0 and 1"),
        ([[1, 2], [3]], "", "differ in length"),
        (["a"], "", "strings"),
    ],
)
def test_what_cannot_be_converted_is_a_type_error_naming_input_and_datatype(
    value: object, datatype: str, reason: str
) -> None:
    with pytest.raises(TypeError) as caught:
        codec.array_of("pixels", value, datatype)
    message = str(caught.value)
    assert "input 'pixels'" in message
    assert (datatype or "a numeric datatype") in message
    assert reason in message


def test_a_datatype_the_codec_cannot_make_is_named() -> None:
    with pytest.raises(TypeError, match=r"input 'x'.*BYTES"):
        codec.array_of("x", [b"a"], "BYTES")


@pytest.mark.parametrize("datatype", ["", "FP32", "FP64", "INT8"])
def test_numpy_arrays_pass_untouched(datatype: str) -> None:
    # The hot path: no conversion and no copy, whatever is declared (the server judges a
    # mismatch and says so).
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert codec.array_of("x", array, datatype) is array
    message = codec.encode("x", array, datatype=datatype)
    assert message.datatype == "FP32"
    assert message.raw_data == array.tobytes()


@pytest.mark.parametrize("typed", [False, True])
def test_every_datatype_from_plain_lists(typed: bool) -> None:
    for name, dt in DATATYPES.items():
        message = codec.encode("x", [[1, 0]], typed=typed, datatype=name)
        back = codec.decode(pb.Tensor.FromString(message.SerializeToString()))
        assert message.datatype == name
        assert back.dtype == dt.dtype.newbyteorder("=")
        np.testing.assert_array_equal(back, np.array([[1, 0]]))


def test_encode_all_takes_each_inputs_declared_datatype() -> None:
    tensors = codec.encode_all(
        {"a": [[1, 2]], "b": [3], "c": np.zeros(2, np.int8)},
        datatypes={"a": "FP32", "b": "UINT8", "c": "FP32"},
    )
    assert [(t.name, t.datatype) for t in tensors] == [("a", "FP32"), ("b", "UINT8"), ("c", "INT8")]


def test_the_client_refuses_a_ragged_list_before_sending() -> None:
    # Nothing listens on port 1: the refusal must come from encoding, before any call.
    with (
        SluiceClient("127.0.0.1:1", timeout=5) as client,
        pytest.raises(TypeError, match=r"input 'input'.*differ in length"),
    ):
        client.predict({"input": [[1.0, 2.0], [3.0]]})


def test_the_client_sends_a_plain_list_as_a_tensor() -> None:
    # Encoded without a complaint, the call goes out and meets the closed port: the list was
    # accepted as a tensor (the e2e tier checks the answer from a real server).
    with (
        SluiceClient("127.0.0.1:1", timeout=5) as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.predict({"input": [[0.0, 1.0]]})
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
