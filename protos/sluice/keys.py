"""The request key: one 128-bit digest of method and body. The server's result cache and the
balancer's affinity ring both use it, so identical requests meet their cached answer."""

from __future__ import annotations

import xxhash

# Callers set this metadata to keep a call out of the cache (and out of affinity routing).
NO_CACHE_HEADER = "x-cache-control"
NO_CACHE_VALUE = "no-cache"


def request_key(method: str, body: bytes) -> bytes:
    h = xxhash.xxh3_128(method.encode())
    h.update(b"\0")
    h.update(body)
    return h.digest()
