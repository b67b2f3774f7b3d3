"""A look at a protobuf body's top-level fields without parsing it: where the model's name
and version sit in a Predict or ModelInfer body, so the server can key its cache and the
balancer route by model without decoding tensors. Pure Python on the wire format."""

from __future__ import annotations

from collections.abc import Collection

Span = tuple[int, int, int]  # the field's tag start, its value's start and end
# Real Predict and ModelInfer bodies have a handful of top-level fields (one per input or
# output at most); walking more in Python would let one crafted 64 MiB body of two-byte
# fields hold the event loop for many seconds.
MAX_FIELDS = 4096


class Malformed(ValueError):
    """The bytes are not a protobuf message."""


def _varint(body: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(body) or shift > 63:
            raise Malformed("truncated varint")
        byte = body[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def spans(body: bytes, wanted: Collection[int]) -> dict[int, Span]:
    """The last occurrence of each wanted length-delimited top-level field (the one a parser
    keeps), by field number. Raises Malformed on bytes no parser would take."""
    found: dict[int, Span] = {}
    at, size, fields = 0, len(body), 0
    while at < size:
        fields += 1
        if fields > MAX_FIELDS:
            raise Malformed(f"more than {MAX_FIELDS} top-level fields")
        start = at
        key, at = _varint(body, at)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise Malformed("field number 0")
        if wire == 2:
            length, at = _varint(body, at)
            end = at + length
            if end > size:
                raise Malformed("a field runs past the end")
            if number in wanted:
                found[number] = (start, at, end)
            at = end
        elif wire == 0:
            _, at = _varint(body, at)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise Malformed(f"wire type {wire}")
    if at > size:
        raise Malformed("a field runs past the end")
    return found


def text(body: bytes, span: Span | None) -> str:
    """A string field's value ('' when absent). Raises Malformed on invalid UTF-8."""
    if span is None:
        return ""
    try:
        return body[span[1] : span[2]].decode()
    except UnicodeDecodeError:
        raise Malformed("a string field is not UTF-8") from None
