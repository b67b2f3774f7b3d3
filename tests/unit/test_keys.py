"""The affinity key: which calls meet on one server."""

from __future__ import annotations

from collections import Counter

from sluice.core.keys import (
    AFFINITY_HEADER,
    NO_CACHE_HEADER,
    NO_CACHE_VALUE,
    affinity_key,
)

BODIES = [b"", b"\x00", b"one body", b"another body", bytes(range(256))]


def test_one_affinity_key_gives_one_ring_key_whatever_the_body() -> None:
    keys = {affinity_key(body, {AFFINITY_HEADER: "user-42"}) for body in BODIES}
    assert len(keys) == 1
    assert keys != {affinity_key(body, {AFFINITY_HEADER: "user-43"}) for body in BODIES}


def test_without_an_affinity_key_the_body_decides() -> None:
    keys = [affinity_key(body, {}) for body in BODIES]
    assert len(set(keys)) == len(BODIES)
    assert keys == [affinity_key(body, {}) for body in BODIES]  # the same body, the same key
    # Other metadata plays no part, and an empty affinity key is no key.
    assert keys == [affinity_key(body, {"x-request-id": "r1"}) for body in BODIES]
    assert keys == [affinity_key(body, {AFFINITY_HEADER: ""}) for body in BODIES]


def test_a_call_that_opts_out_of_the_cache_has_no_key_even_with_an_affinity_key() -> None:
    assert affinity_key(b"body", {NO_CACHE_HEADER: NO_CACHE_VALUE}) is None
    assert affinity_key(b"body", {NO_CACHE_HEADER: NO_CACHE_VALUE, AFFINITY_HEADER: "k"}) is None
    assert affinity_key(b"body", {NO_CACHE_HEADER: "max-age=0"}) is not None  # only no-cache


def test_affinity_keys_are_64_bit_and_spread_evenly() -> None:
    keys = [affinity_key(b"body", {AFFINITY_HEADER: f"user-{i}"}) for i in range(3000)]
    assert all(k is not None and 0 <= k < 2**64 for k in keys)
    assert len(set(keys)) == len(keys)
    # Top bits, which a ring compares first: each of 8 slices gets its share, within 15%.
    slices = Counter(k >> 61 for k in keys if k is not None)
    assert sorted(slices) == list(range(8))
    assert all(abs(n - 3000 / 8) < 0.15 * 3000 / 8 for n in slices.values()), slices
