"""The affinity key (which calls meet on one server's cache) and the metadata that steers it."""

from __future__ import annotations

from collections.abc import Mapping

import xxhash

NO_CACHE_HEADER = "x-cache-control"
NO_CACHE_VALUE = "no-cache"
AFFINITY_HEADER = "x-affinity-key"
PREDICT = "/sluice.v1.Inference/Predict"
# A trailer on a call refused before any work, which another server may take.
REFUSED_HEADER = "x-refused"
OVERLOADED = "overloaded"
DRAINING = "draining"
RETRY_AFTER_HEADER = "retry-after-ms"


def affinity_key(
    body: bytes, metadata: Mapping[str, str], cut: tuple[int, int] | None = None
) -> int | None:
    """The ring key of a call: the caller's own key, else the body's digest (less the span
    `cut`, hashed over views: a join copied a 602 KB body twice); None for no-cache."""
    if metadata.get(NO_CACHE_HEADER) == NO_CACHE_VALUE:
        return None
    given = metadata.get(AFFINITY_HEADER)
    if given or cut is None:
        return xxhash.xxh3_64_intdigest(given.encode() if given else body)
    view = memoryview(body)
    digest = xxhash.xxh3_64(view[: cut[0]])
    digest.update(view[cut[1] :])
    return digest.intdigest()
