"""The PredictRequest body the client sends (codec.encode_predict): the message protobuf
writes plus a padding field before each raw_data, so that the server reads every input as
an aligned view of the body, on every path that reads it (the wire read, the full parser,
the routing read, a PredictStream message's body)."""

from __future__ import annotations

import numpy as np
from google.protobuf import descriptor_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sluice.core.datatypes import DATATYPES
from sluice.server.v1 import SluiceV1
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec, facts, peek

V1 = SluiceV1()  # the server's plain sluice.v1 protocol

DTYPES = [d.dtype.newbyteorder("=") for d in DATATYPES.values()]


def views(body: bytes) -> dict[str, np.ndarray]:
    read = codec.decode_predict(body)
    assert read is not None, "the wire reader stepped aside"
    return read[0]


def raw_offsets(body: bytes) -> list[int]:
    """Where each input's raw_data starts in the body."""
    found = []
    for number, _, a, b in peek.fields(body, 0, len(body)):
        if number == facts.PREDICT_INPUTS:
            found += [x for n, _, x, _ in peek.fields(body, a, b) if n == facts.TENSOR_RAW_DATA]
    return found


def test_an_image_is_read_as_a_view_of_the_body() -> None:
    x = np.random.default_rng(0).random((1, 3, 224, 224), np.float32)
    body = codec.encode_predict({"input": x}, ["output"], "pool", "1")
    got = views(body)["input"]
    assert got.flags.aligned
    assert np.shares_memory(got, np.frombuffer(body, np.uint8))
    np.testing.assert_array_equal(got, x)


inputs = st.dictionaries(
    st.text(max_size=70),  # names long enough to move every offset through 64
    st.sampled_from(DTYPES).flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0))
    ),
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(
    inputs=inputs,
    outputs=st.lists(st.text(max_size=3), max_size=2),
    model=st.text(max_size=3),
    version=st.text(max_size=3),
)
def test_every_input_starts_aligned_and_the_message_is_protobuf_s(
    inputs: dict[str, np.ndarray], outputs: list[str], model: str, version: str
) -> None:
    body = codec.encode_predict(inputs, outputs, model, version)
    assert all(at % codec.ALIGN == 0 for at in raw_offsets(body))
    # What a parser keeps, less the padding it keeps as unknown: protobuf's own message.
    parsed = pb.PredictRequest.FromString(body)
    parsed.DiscardUnknownFields()
    want = pb.PredictRequest(
        inputs=codec.encode_all(inputs), outputs=outputs, model=model, version=version
    )
    assert parsed.SerializeToString() == want.SerializeToString()
    arrays = views(body)
    whole = np.frombuffer(body, np.uint8)
    for name, array in inputs.items():
        got = arrays[name]
        assert got.flags.aligned
        assert not got.nbytes or np.shares_memory(got, whole)
        np.testing.assert_array_equal(got, array)
    # The full parser's path (small bodies, typed values) reads the same arrays.
    for name, array in V1.decode(body).inputs.items():
        np.testing.assert_array_equal(array, inputs[name])


def test_padding_that_lengthens_a_tensor_s_length_still_aligns() -> None:
    """Tensors whose length is near where its varint takes a byte more (128, 16384), at
    every offset a name can put them."""
    for size in [*range(60, 140), *range(16300, 16400, 7)]:
        x = np.zeros(size, np.uint8)
        for name in ("", "x" * 1, "x" * 63, "x" * 64, *("y" * n for n in range(2, 62, 3))):
            body = codec.encode_predict({"first": np.ones(3, np.int8), name: x})
            assert all(at % codec.ALIGN == 0 for at in raw_offsets(body))
            assert pb.PredictRequest.FromString(body).inputs[1].raw_data == x.tobytes()


def test_the_routing_read_sees_through_the_padding() -> None:
    x = np.zeros((5, 3), np.float32)
    body = codec.encode_predict({"a": x, "bb": np.zeros((5,), np.int64)}, model="m", version="2")
    read = facts.read(body, facts.PREDICT, rows=True)
    assert (read.model, read.version, read.rows) == ("m", "2", 5)


def test_a_body_inside_a_stream_message_is_still_read_as_a_view() -> None:
    """The server takes a PredictStream message's body as its own bytes (the `request`
    field, copied out of the parsed message): its inputs are where the client put them."""
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    body = codec.encode_predict({"input": x})
    for call in (1, 300, 2**40):  # ids of 1, 2 and 6 bytes move the body in the message
        message = pb.StreamRequest(id=call, request=body, timeout_s=1.0).SerializeToString()
        request = pb.StreamRequest.FromString(message).request
        got = views(request)["input"]
        assert got.flags.aligned and np.shares_memory(got, np.frombuffer(request, np.uint8))


def test_the_padding_field_is_reserved_in_the_schema() -> None:
    """No field may ever take its number, and JSON and grpcurl users never see it."""
    schema = descriptor_pb2.DescriptorProto()
    pb.Tensor.DESCRIPTOR.CopyToProto(schema)
    reserved = [(r.start, r.end) for r in schema.reserved_range]
    assert any(a <= codec.PADDING < b for a, b in reserved)
    assert codec.PADDING not in pb.Tensor.DESCRIPTOR.fields_by_number
