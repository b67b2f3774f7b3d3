"""Reading a body's top-level fields without parsing it: the spans a parser would keep,
and every malformed body refused, cheaply."""

from __future__ import annotations

import pytest

from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.v1 import inference_pb2 as pb
from sluice.wire import peek


def test_the_fields_a_parser_keeps() -> None:
    body = pb.PredictRequest(
        inputs=[pb.Tensor(name="x", raw_data=b"\0" * 300)], model="m", version="2"
    ).SerializeToString()
    found = peek.spans(body, (4, 5))
    assert (peek.text(body, found[4]), peek.text(body, found[5])) == ("m", "2")
    assert peek.text(body, peek.spans(body, (9,)).get(9)) == ""
    twice = kpb.ModelInferRequest(id="a").SerializeToString() + (
        kpb.ModelInferRequest(id="b").SerializeToString()
    )
    assert kpb.ModelInferRequest.FromString(twice).id == "b"  # the last one wins ...
    assert peek.text(twice, peek.spans(twice, (3,))[3]) == "b"  # ... here too


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
        peek.spans(body, (4, 5))


def test_a_string_that_is_not_utf8_is_refused() -> None:
    body = b"\x22\x02\xff\xfe"
    with pytest.raises(peek.Malformed, match="not UTF-8"):
        peek.text(body, peek.spans(body, (4,))[4])
