"""What a message over a process's --max-message-bytes is answered with: whose limit it was
over and the flag that raises it, in one text for the server's replies and the balancer's
requests and replies (grpc's own words name neither: `Sent message larger than max`)."""

from __future__ import annotations

RAISE = (
    "start it with a larger --max-message-bytes (or SLUICE_MAX_MESSAGE_BYTES); a balancer "
    "and each server behind it have their own"
)


def too_large(message: str, size: int, holder: str, limit: int, measured: str = "") -> str:
    """`message` ("request", "reply") of `size` bytes (`measured`: how, when it needs saying)
    over the limit of `holder` ("server a", "the server at HOST:PORT"), and how to raise it."""
    return (
        f"the {message} ({size} bytes{measured}) is over the limit of {holder} ({limit}): {RAISE}"
    )
