"""A request body parsed as its message, refused in the parser's words."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from sluice.core.errors import InvalidInput

M = TypeVar("M", bound=Message)


def parse(kind: type[M], body: bytes) -> M:
    """A request body as `kind` (any call's), refused (INVALID_ARGUMENT) in the parser's
    words."""
    try:
        return kind.FromString(body)
    except DecodeError as exc:
        raise InvalidInput(
            f"request body is not a valid {kind.DESCRIPTOR.full_name} message: {exc}"
        ) from None
