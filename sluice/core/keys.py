"""The request key: one 128-bit digest of method and body. The server's result cache and the
balancer's affinity ring both use it, so identical requests meet their cached answer."""

from __future__ import annotations

from collections.abc import Mapping

import xxhash

# Callers set this metadata to keep a call out of the cache (and out of affinity routing).
NO_CACHE_HEADER = "x-cache-control"
NO_CACHE_VALUE = "no-cache"
# Callers may give their own affinity key; calls with the same key go to the same server.
AFFINITY_HEADER = "x-affinity-key"
PREDICT = "/sluice.v1.Inference/Predict"


def request_key(method: str, body: bytes) -> bytes:
    h = xxhash.xxh3_128(method.encode())
    h.update(b"\0")
    h.update(body)
    return h.digest()


def affinity_key(body: bytes, metadata: Mapping[str, str]) -> int | None:
    """The ring key of a Predict call: the caller's own key if given, else the request's
    digest; None when the call opts out of caching (it then goes to the least loaded)."""
    if metadata.get(NO_CACHE_HEADER) == NO_CACHE_VALUE:
        return None
    given = metadata.get(AFFINITY_HEADER)
    digest = request_key(PREDICT, given.encode() if given else body)
    return int.from_bytes(digest[:8], "big")
