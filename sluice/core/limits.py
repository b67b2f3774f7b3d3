"""What a message over --max-message-bytes is answered with: whose limit, and the flag that
raises it (grpc's own words name neither)."""

from __future__ import annotations

RAISE = (
    "start it with a larger --max-message-bytes (or SLUICE_MAX_MESSAGE_BYTES); a balancer "
    "and each server behind it have their own"
)


def too_large(message: str, size: int, holder: str, limit: int, measured: str = "") -> str:
    """`message` of `size` bytes over `holder`'s limit, and how to raise it."""
    return (
        f"the {message} ({size} bytes{measured}) is over the limit of {holder} ({limit}): {RAISE}"
    )
