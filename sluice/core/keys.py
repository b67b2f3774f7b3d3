"""The affinity key: which calls meet on one server (and so its result cache), and the
metadata callers steer it with. Identical bodies get one key."""

from __future__ import annotations

from collections.abc import Mapping

import xxhash

# Callers set this metadata to keep a call out of the cache (and out of affinity routing).
NO_CACHE_HEADER = "x-cache-control"
NO_CACHE_VALUE = "no-cache"
# Callers may give their own affinity key; calls with the same key go to the same server.
AFFINITY_HEADER = "x-affinity-key"
PREDICT = "/sluice.v1.Inference/Predict"
# A trailer on a call refused before any work, which another server may take: its server (or
# every server behind a balancer) is at its limit (RESOURCE_EXHAUSTED), or it is draining
# (UNAVAILABLE).
REFUSED_HEADER = "x-refused"
OVERLOADED = "overloaded"
DRAINING = "draining"
# A trailer on a call refused for its tenant's rate quota: milliseconds until it may pass.
RETRY_AFTER_HEADER = "retry-after-ms"


def affinity_key(
    body: bytes, metadata: Mapping[str, str], cut: tuple[int, int] | None = None
) -> int | None:
    """The ring key of a Predict call: the caller's own key if given, else the request's
    digest; None when the call opts out of caching (it then goes to the least loaded).
    `cut`: a span of the body left out of the digest (KServe's id field, Facts.id_span),
    which is then taken over views of the two parts around it: the key of their join
    (Facts.keyed) without the join, which copied a 602 KB body twice over."""
    if metadata.get(NO_CACHE_HEADER) == NO_CACHE_VALUE:
        return None
    given = metadata.get(AFFINITY_HEADER)
    if given or cut is None:
        return xxhash.xxh3_64_intdigest(given.encode() if given else body)
    view = memoryview(body)
    digest = xxhash.xxh3_64(view[: cut[0]])
    digest.update(view[cut[1] :])
    return digest.intdigest()
