"""PredictRequest read straight off the wire (codec.decode_predict) against the full parser
(parse + codec.decode_all): the same arrays, outputs and options, the same TensorError
messages, and the full parser wherever the wire reader steps aside."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.errors import InvalidInput
from sluice.server.v1 import WIRE_READ_FROM, SluiceV1
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec

V1 = SluiceV1()  # the server's plain sluice.v1 protocol


def slow(body: bytes) -> tuple[dict[str, np.ndarray], list[str], bool]:
    request = pb.PredictRequest.FromString(body)
    return codec.decode_all(request.inputs), list(request.outputs), request.typed_outputs


def outcome(read: object) -> object:
    try:
        got = read()  # type: ignore[operator]
    except codec.TensorError as exc:
        return ("error", str(exc))
    assert got is not None, "the wire reader stepped aside"
    arrays, outputs, typed = got
    return (
        {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in arrays.items()},
        list(outputs),
        typed,
    )


def same(body: bytes) -> None:
    assert outcome(lambda: codec.decode_predict(body)) == outcome(lambda: slow(body))


def tensor(name: str, array: np.ndarray) -> pb.Tensor:
    return codec.encode(name, array)


def test_a_typical_request_and_its_options() -> None:
    x = np.random.default_rng(0).random((2, 64), np.float32)
    body = pb.PredictRequest(
        inputs=[tensor("input", x)],
        outputs=["label"],
        typed_outputs=True,
        model="digits",
        version="3",
    ).SerializeToString()
    same(body)
    arrays, outputs, typed = codec.decode_predict(body)  # type: ignore[misc]
    np.testing.assert_array_equal(arrays["input"], x)
    assert (outputs, typed) == (["label"], True)


@pytest.mark.parametrize(
    "tensors",
    [
        [pb.Tensor(name="x", datatype="FP32", shape=[1, 3], raw_data=b"\0" * 11)],  # short
        [pb.Tensor(name="x", datatype="FP99", shape=[1], raw_data=b"\0" * 4)],
        [pb.Tensor(name="x", datatype="FP32", shape=[-1, 2], raw_data=b"")],
        [pb.Tensor(name="x", datatype="FP32", shape=[1] * 65, raw_data=b"\0" * 4)],
        [pb.Tensor(name="x", datatype="FP32", shape=[2**30, 2**30], raw_data=b"")],
        [pb.Tensor(name="b", datatype="BOOL", shape=[2], raw_data=b"\x01\x02")],
        [pb.Tensor(datatype="INT64", shape=[1], raw_data=b"\0" * 8)],  # no name
        [pb.Tensor(name="x", datatype="INT8", shape=[0, 3])],  # empty
        [
            pb.Tensor(name="x", datatype="UINT8", shape=[1], raw_data=b"\x07"),
            pb.Tensor(name="x", datatype="UINT8", shape=[1], raw_data=b"\x08"),
        ],
        [],
    ],
    ids=[
        "short",
        "datatype",
        "negative",
        "rank",
        "huge",
        "bool",
        "noname",
        "empty",
        "twice",
        "none",
    ],
)
def test_faults_and_edges_match_the_full_parser(tensors: list[pb.Tensor]) -> None:
    same(pb.PredictRequest(inputs=tensors).SerializeToString())


def test_an_unpacked_shape_and_unknown_fields_are_read_as_the_parser_reads_them() -> None:
    raw = np.arange(6, dtype=np.int32).tobytes()
    # Tensor: name "x", datatype "INT32", shape 2 and 3 as two unpacked varints, an unknown
    # field 20 (varint), raw_data; the request adds an unknown field 9 (bytes).
    inner = b"\x0a\x01x" + b"\x12\x05INT32" + b"\x18\x02\x18\x03" + b"\xa0\x01\x05"
    inner += b"\x22" + bytes([len(raw)]) + raw
    body = b"\x0a" + bytes([len(inner)]) + inner + b"\x4a\x02hi"
    same(body)
    arrays, _, _ = codec.decode_predict(body)  # type: ignore[misc]
    np.testing.assert_array_equal(arrays["x"], np.arange(6, dtype=np.int32).reshape(2, 3))


def test_the_arrays_are_views_of_the_body_where_aligned() -> None:
    x = np.arange(64, dtype=np.float32).reshape(1, 64)
    views = 0
    for name in ("i", "in", "inp", "input"):  # shifts raw_data's offset in the body
        body = pb.PredictRequest(inputs=[tensor(name, x)]).SerializeToString()
        arrays, _, _ = codec.decode_predict(body)  # type: ignore[misc]
        got = arrays[name]
        np.testing.assert_array_equal(got, x)
        assert got.flags.aligned
        whole = np.frombuffer(body, np.uint8)
        assert np.shares_memory(got, whole) == (not got.flags.writeable)
        views += np.shares_memory(got, whole)
    assert views >= 1  # one offset in four is a multiple of 4


@pytest.mark.parametrize(
    "body",
    [
        pb.PredictRequest(
            inputs=[pb.Tensor(name="x", datatype="FP32", shape=[1], fp32_data=[1.5])]
        ).SerializeToString(),  # typed values
        b"\x0a\x05\x0a\x03abc\xff",  # a tensor that runs past the end
        b"\x08\x01",  # inputs as a varint: a wire type the parser judges
        b"\x22\x02\xff\xfe",  # a model name that is not UTF-8
        b"\x0a\x04\x0a\x02\xc3\x28",  # a tensor name that is not UTF-8
    ],
    ids=["typed", "truncated", "wiretype", "model-utf8", "name-utf8"],
)
def test_the_full_parser_judges_what_the_wire_reader_leaves(body: bytes) -> None:
    assert codec.decode_predict(body) is None


names = st.text(alphabet="abcxyz_", max_size=4)
dtypes = st.sampled_from(["FP32", "INT64", "UINT8", "FP16", "BOOL", "INT8", "FP64", "INT32"])


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(
        st.tuples(names, dtypes, st.lists(st.integers(0, 3), max_size=3), st.binary(max_size=40)),
        max_size=3,
    ),
    outputs=st.lists(names, max_size=2),
    typed=st.booleans(),
)
def test_any_raw_request_reads_as_the_parser_reads_it(
    specs: list[tuple[str, str, list[int], bytes]], outputs: list[str], typed: bool
) -> None:
    tensors = [pb.Tensor(name=n, datatype=d, shape=s, raw_data=r) for n, d, s, r in specs]
    body = pb.PredictRequest(
        inputs=tensors, outputs=outputs, typed_outputs=typed
    ).SerializeToString()
    same(body)


def test_the_server_reads_large_bodies_off_the_wire_and_small_ones_parsed() -> None:
    for rows in (1, WIRE_READ_FROM // 256 + 1):  # 256 bytes a row of 64 FP32
        x = np.random.default_rng(rows).random((rows, 64), np.float32)
        body = pb.PredictRequest(inputs=[tensor("input", x)], outputs=["label"]).SerializeToString()
        request = V1.decode(body)
        np.testing.assert_array_equal(request.inputs["input"], x)
        assert list(request.outputs) == ["label"]


def test_a_crafted_body_of_many_fields_goes_to_the_parser() -> None:
    """The walk is Python: its fields are budgeted over the whole body (tensors included),
    and a packed shape longer than MAX_RANK dimensions could take is not walked at all."""
    many_top = b"\x4a\x00" * 5000  # unknown field 9, empty, 5000 times
    assert codec.decode_predict(many_top) is None
    inner = b"\x0a\x01x" + b"\xa0\x01\x00" * 5000  # one tensor of 5000 unknown varints
    many_inner = b"\x0a" + _varint(len(inner)) + inner
    assert codec.decode_predict(many_inner) is None
    split = b"".join(  # 3 tensors of 2,000 fields each: each alone under the budget
        b"\x0a" + _varint(len(t)) + t
        for t in [b"\x0a\x01" + bytes([97 + i]) + b"\xa0\x01\x00" * 2000 for i in range(3)]
    )
    assert codec.decode_predict(split) is None
    shape = pb.Tensor(name="x", datatype="FP32", shape=[1] * 700)
    long_shape = pb.PredictRequest(inputs=[shape]).SerializeToString()
    assert codec.decode_predict(long_shape) is None
    with pytest.raises(InvalidInput, match="700 dimensions; at most 64"):
        V1.decode(long_shape + b"\x4a" + _varint(WIRE_READ_FROM) + bytes(WIRE_READ_FROM))


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@pytest.mark.parametrize(
    "extra",
    [
        b"\xb1\xff\xff\xff\xff\xff\x00" + bytes(8),  # a 7-byte tag (found by tests/fuzz)
        b"\xc8\x80\x80\x80\x80\x00\x01",  # an unknown varint field, its tag padded to 6 bytes
        b"\x4a\x80\x80\x80\x80\x80\x00",  # an unknown bytes field, its length padded to 6
    ],
    ids=["long-tag", "padded-tag", "padded-length"],
)
def test_a_body_the_parser_refuses_for_its_tags_or_lengths_is_not_answered(extra: bytes) -> None:
    body = pb.PredictRequest(inputs=[tensor("x", np.ones((1, 2), np.float32))]).SerializeToString()
    with pytest.raises(DecodeError):
        pb.PredictRequest.FromString(body + extra)
    assert codec.decode_predict(body + extra) is None
    inner = pb.Tensor(name="x", datatype="UINT8", shape=[1], raw_data=b"\x07").SerializeToString()
    inner += extra  # the same, inside the tensor
    wrapped = b"\x0a" + _varint(len(inner)) + inner
    with pytest.raises(DecodeError):
        pb.PredictRequest.FromString(wrapped)
    assert codec.decode_predict(wrapped) is None


def test_a_shape_dimension_of_ten_bytes_reads_as_the_parser_reads_it() -> None:
    """Bits past 64 in a varint's tenth byte are dropped: the dimension is 2, not 2 + 2**65."""
    dims = b"\x82" + b"\x80" * 8 + b"\x04"
    inner = b"\x0a\x01x\x12\x05UINT8\x1a" + bytes([len(dims)]) + dims + b"\x22\x02\x01\x02"
    body = b"\x0a" + bytes([len(inner)]) + inner
    assert list(pb.PredictRequest.FromString(body).inputs[0].shape) == [2]
    same(body)


def test_a_view_of_a_larger_message_reads_as_its_bytes() -> None:
    """A body handed over as a memoryview of the message around it (a stream message's
    bytes): the same reading, the arrays views of that message, the strings its text."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    body = pb.PredictRequest(
        inputs=[tensor("ïnput", x)], outputs=["label"], model="digits", version="3"
    ).SerializeToString()
    for before in range(4):
        message = bytes(range(before)) + body + b"\x01\x02"
        view = memoryview(message)[before : before + len(body)]
        assert outcome(lambda v=view: codec.decode_predict(v)) == outcome(lambda: slow(body))
        arrays, _, _ = codec.decode_predict(view)  # type: ignore[misc]
        got = arrays["ïnput"]
        whole = np.frombuffer(message, np.uint8)
        assert got.flags.aligned and np.shares_memory(got, whole) == (not got.flags.writeable)
    bad = b"\x22\x02\xff\xfe"  # a model name that is not UTF-8: the parser's to refuse
    assert codec.decode_predict(memoryview(b"\0" + bad)[1:]) is None
