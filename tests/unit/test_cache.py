"""The LRU result cache and single-flight."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.server.dataplane.cache import Entry, LRUCache, SingleFlight


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_hit_makes_an_entry_young_again() -> None:
    cache = LRUCache(max_entries=3, max_bytes=10_000)
    for i in range(3):
        cache.put(key(i), Entry(b"x"))
    assert cache.get(key(0)) is not None  # 0 is now the youngest
    cache.put(key(3), Entry(b"x"))
    assert key(1) not in cache  # LRU, not FIFO: 1 was the least recently used
    assert cache.keys() == [key(2), key(0), key(3)]
    assert cache.evictions == 1


@given(
    st.lists(
        st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 12), st.integers(0, 60)),
        max_size=200,
    ),
    st.integers(1, 6),
    st.integers(1, 150),
)
def test_matches_a_reference_lru_and_keeps_its_byte_account(
    ops: list[tuple[str, int, int]], max_entries: int, max_bytes: int
) -> None:
    cache = LRUCache(max_entries, max_bytes)
    model: list[tuple[bytes, int]] = []  # oldest first: (key, size)
    for op, k, size in ops:
        if op == "get":
            hit = cache.get(key(k))
            found = [m for m in model if m[0] == key(k)]
            assert (hit is not None) == bool(found)
            if found:
                model.remove(found[0])
                model.append(found[0])
                assert hit is not None and len(hit.body) == found[0][1]
        else:
            cache.put(key(k), Entry(b"v" * size))
            if size <= max_bytes:
                model = [m for m in model if m[0] != key(k)] + [(key(k), size)]
                while len(model) > max_entries or sum(s for _, s in model) > max_bytes:
                    model.pop(0)
        assert cache.keys() == [m[0] for m in model]
        assert cache.bytes == sum(s for _, s in model) <= max_bytes
        assert len(cache) <= max_entries


def test_flags_count_towards_bytes() -> None:
    cache = LRUCache(10, 100)
    cache.put(key(1), Entry(b"a" * 10, nonfinite=("input", "mask")))
    assert cache.bytes == 10 + len("input") + len("mask")


def test_disabled_cache_keeps_nothing() -> None:
    cache = LRUCache(0, 0)
    cache.put(key(1), Entry(b"a"))
    assert len(cache) == 0 and cache.get(key(1)) is None


async def test_single_flight_runs_once_for_concurrent_callers() -> None:
    flight = SingleFlight()
    runs = 0
    release = asyncio.Event()

    async def compute() -> Entry:
        nonlocal runs
        runs += 1
        await release.wait()
        return Entry(b"answer")

    callers = [asyncio.create_task(flight.run(key(1), compute)) for _ in range(10)]
    await asyncio.sleep(0)
    release.set()
    results = [entry for entry, _ in await asyncio.gather(*callers)]
    assert runs == 1 and flight.joined == 9
    assert {r.body for r in results} == {b"answer"}
    assert len(flight) == 0  # done flights are forgotten: the cache keeps results


async def test_a_cancelled_caller_does_not_cancel_the_others() -> None:
    flight = SingleFlight()
    release = asyncio.Event()

    async def compute() -> Entry:
        await release.wait()
        return Entry(b"answer")

    first = asyncio.create_task(flight.run(key(1), compute))
    second = asyncio.create_task(flight.run(key(1), compute))
    await asyncio.sleep(0)
    first.cancel()
    release.set()
    assert (await second)[0].body == b"answer"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_failures_reach_every_caller_and_are_not_remembered() -> None:
    flight = SingleFlight()

    async def fail() -> Entry:
        await asyncio.sleep(0)
        raise ValueError("bad input")

    results = await asyncio.gather(
        *(flight.run(key(1), fail) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, ValueError) for r in results)

    async def succeed() -> Entry:
        return Entry(b"ok")

    assert (await flight.run(key(1), succeed))[0].body == b"ok"
