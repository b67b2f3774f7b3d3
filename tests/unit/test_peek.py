"""Walking a body's fields without parsing it: the fields a parser would keep (as the
routing read, sluice.wire.facts, keeps them), and every malformed body refused, cheaply."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.v1 import inference_pb2 as pb
from sluice.wire import facts, peek


def walk(body: bytes) -> list[peek.Field]:
    return list(peek.fields(body, 0, len(body)))


def test_the_fields_a_parser_keeps() -> None:
    body = pb.PredictRequest(
        inputs=[pb.Tensor(name="x", raw_data=b"\0" * 300)], model="m", version="2"
    ).SerializeToString()
    read = facts.read(body, facts.PREDICT)
    assert (read.model, read.version) == ("m", "2")
    only = pb.PredictRequest(model="m").SerializeToString()
    assert facts.read(only, facts.PREDICT).version == ""  # absent: empty
    twice = kpb.ModelInferRequest(id="a").SerializeToString() + (
        kpb.ModelInferRequest(id="b").SerializeToString()
    )
    assert kpb.ModelInferRequest.FromString(twice).id == "b"  # the last one wins ...
    assert facts.read(twice, facts.MODEL_INFER).request_id == "b"  # ... here too


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\x22\x05ab", "runs past the end"),  # length 5, 2 bytes left
        (b"\x22", "truncated varint"),
        (b"\x80" * 11, "truncated varint"),
        (b"\x00\x01", "field number 0"),
        (b"\x23", "wire type 3"),  # groups are not in these messages
        (b"\x78\x00" * (peek.MAX_FIELDS + 1), "more than"),  # a flood of tiny fields
    ],
)
def test_malformed_bodies_are_refused(body: bytes, why: str) -> None:
    with pytest.raises(peek.Malformed, match=why):
        walk(body)


def test_a_string_that_is_not_utf8_is_refused() -> None:
    body = b"\x22\x02\xff\xfe"
    with pytest.raises(peek.Malformed, match="not UTF-8"):
        facts.read(body, facts.PREDICT)


@pytest.mark.parametrize(
    "body",
    [
        b"\xb1\xff\xff\xff\xff\xff\x00" + bytes(8),  # a 7-byte tag (found by tests/fuzz)
        b"\xca\x80\x80\x80\x80\x00\x00",  # field 9's tag padded to 6 bytes
        b"\xc8\x80\x80\x80\x10\x00",  # a 5-byte tag over 32 bits
        b"\x4a\x80\x80\x80\x80\x80\x00",  # a length padded to 6 bytes
    ],
    ids=["long-tag", "padded-tag", "wide-tag", "padded-length"],
)
def test_tags_and_lengths_the_parser_refuses_are_refused(body: bytes) -> None:
    """A tag is at most 5 bytes and 32 bits, a length at most 5 bytes, to protobuf."""
    with pytest.raises(DecodeError):
        pb.PredictRequest.FromString(body)
    with pytest.raises(peek.Malformed):
        walk(body)


def test_the_widest_tags_lengths_and_varints_the_parser_takes_read_as_it_reads_them() -> None:
    body = b"\xa2\x80\x80\x80\x00" + b"\x81\x80\x80\x80\x00" + b"m"  # 5-byte tag and length
    assert pb.PredictRequest.FromString(body).model == "m"
    assert facts.read(body, facts.PREDICT).model == "m"
    # A tenth byte's bits past 64 are dropped: these ten bytes are -1 to the parser.
    wide = b"\xff" * 9 + b"\x7f"
    assert list(pb.Tensor.FromString(b"\x1a\x0a" + wide).shape) == [-1]
    assert peek.varints(wide, 0, len(wide)) == [-1]
    assert next(peek.fields(b"\x18" + wide, 0, 11)) == (3, 0, (1 << 64) - 1, 0)
