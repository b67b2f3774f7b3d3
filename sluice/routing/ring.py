"""Consistent hashing with bounded loads. Transport-free.

A Maglev lookup table (Eisenbud et al., NSDI 2016) over backend identities spreads keys
almost exactly evenly, and when a backend joins or leaves only about 1/n of the keys move.
`preference(key)` lists the backends in the order a key tries them. With bounded loads
(Mirrokni, Thorup, Zadimoghaddam 2016), a key goes to the first backend in that order
whose in-flight load stays within c times the mean (c = 1.25 by default), so a hot key
spills over to the next backend instead of piling onto one."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import xxhash

TABLE_SIZE = 65_537  # prime; much larger than any backend count, so shares are near-equal


def _hash(text: str, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(text.encode(), seed=seed)


class MaglevRing:
    def __init__(self, nodes: Iterable[str], table_size: int = TABLE_SIZE) -> None:
        self.nodes: list[str] = sorted(set(nodes))
        self.size = table_size
        self.table = self._populate() if self.nodes else []

    def _populate(self) -> list[int]:
        m, n = self.size, len(self.nodes)
        offsets = [_hash(node, 1) % m for node in self.nodes]
        skips = [_hash(node, 2) % (m - 1) + 1 for node in self.nodes]
        nexts = [0] * n
        table = [-1] * m
        filled = 0
        while True:
            for i in range(n):
                slot = (offsets[i] + nexts[i] * skips[i]) % m
                while table[slot] >= 0:
                    nexts[i] += 1
                    slot = (offsets[i] + nexts[i] * skips[i]) % m
                table[slot] = i
                nexts[i] += 1
                filled += 1
                if filled == m:
                    return table

    def owner(self, key: int) -> str:
        return self.nodes[self.table[key % self.size]]

    def preference(self, key: int) -> Iterator[str]:
        """Every backend once, the key's owner first, then the next distinct ones in the table."""
        seen: set[int] = set()
        slot = key % self.size
        for step in range(self.size):
            index = self.table[(slot + step) % self.size]
            if index not in seen:
                seen.add(index)
                yield self.nodes[index]
                if len(seen) == len(self.nodes):
                    return


def load_bound(total_in_flight: int, backends: int, factor: float) -> int:
    """The most calls one backend may hold, counting the one being placed."""
    return max(1, math.ceil(factor * (total_in_flight + 1) / backends))


def pick_bounded(
    ring: MaglevRing,
    key: int,
    eligible: Sequence[str],
    load: Callable[[str], int],
    factor: float = 1.25,
) -> str | None:
    """The first eligible backend in the key's preference whose load, with this call, stays
    within the bound; None when nothing is eligible."""
    if not eligible:
        return None
    allowed = set(eligible)
    bound = load_bound(sum(load(b) for b in eligible), len(eligible), factor)
    for node in ring.preference(key):
        if node in allowed and load(node) + 1 <= bound:
            return node
    return None  # unreachable: some eligible backend is always at or below the mean
