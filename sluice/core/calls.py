"""A call's request id and a stream message's time left, checked alike by server and balancer."""

from __future__ import annotations

import math

from sluice.core.errors import InvalidInput

BAD_REQUEST_ID = "x-request-id must be printable ASCII"


def printable(value: str) -> bool:
    """Whether `value` may travel back as a gRPC metadata value (printable ASCII)."""
    return value.isascii() and value.isprintable()  # C loops: this is on every call


def check_request_id(request_id: str) -> None:
    """InvalidInput unless the id can be echoed back (grpc cannot send other values)."""
    if not printable(request_id):
        raise InvalidInput(BAD_REQUEST_ID)


def stream_timeout(timeout_s: float) -> float | None:
    """A StreamRequest's `timeout_s` as time left (None: 0 or infinity); InvalidInput if bad."""
    if math.isnan(timeout_s) or timeout_s < 0:
        raise InvalidInput(f"timeout_s must be a number >= 0 (0: no deadline), not {timeout_s}")
    return None if timeout_s == 0 or math.isinf(timeout_s) else timeout_s
