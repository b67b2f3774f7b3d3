"""Result cache: a true LRU over serialized responses, bounded by entries and bytes, and
single-flight so identical requests in flight at once compute once. Transport-free."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Entry:
    """An answer as its wire protocol encoded it, and what the protocol may flag with it."""

    body: bytes
    nonfinite: tuple[str, ...] = ()  # inputs that held NaN or infinity: allowed, but flagged


class LRUCache:
    """Least recently *used*: a hit moves the entry to the young end."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.enabled = max_entries > 0 and max_bytes > 0
        self._entries: OrderedDict[bytes, tuple[Entry, int]] = OrderedDict()  # with its size
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found[0]

    def put(self, key: bytes, entry: Entry) -> None:
        size = len(entry.body) + sum(map(len, entry.nonfinite))
        if not self.enabled or size > self.max_bytes:
            return  # too big to keep: caching it would flush everything else
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = entry, size
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
            self.evictions += 1

    def keys(self) -> list[bytes]:
        """Oldest first."""
        return list(self._entries)

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0


class SingleFlight:
    """Runs one computation per key at a time; callers arriving meanwhile share its result.

    The computation runs in its own task, so a caller that cancels leaves it running for the
    others; its outcome (result or exception) goes to every caller, each told whether it
    shared another's (as Go's singleflight tells)."""

    def __init__(self) -> None:
        self._flights: dict[bytes, asyncio.Task[Entry]] = {}
        self.joined = 0  # callers that shared another caller's computation

    def __len__(self) -> int:
        return len(self._flights)

    async def run(
        self,
        key: bytes,
        compute: Callable[[], Awaitable[Entry]],
        retry: Callable[[Exception], bool] | None = None,
    ) -> tuple[Entry, bool]:
        """The entry for `key`, and whether it was shared: another caller's computation,
        already running, answered (`compute` is then not called). A shared computation's
        failure that `retry` takes for its leader's own (its deadline) is tried again."""
        while True:
            task = self._flights.get(key)
            shared = task is not None
            if task is None:
                task = asyncio.ensure_future(compute())
                self._flights[key] = task

                def done(finished: asyncio.Task[Entry]) -> None:
                    self._flights.pop(key, None)
                    # Every caller may have gone (cancelled): the outcome is then read here,
                    # so asyncio does not log it as an exception nobody retrieved.
                    if not finished.cancelled():
                        finished.exception()

                task.add_done_callback(done)
            else:
                self.joined += 1
            try:
                return await asyncio.shield(task), shared
            except Exception as exc:
                if not (shared and retry is not None and retry(exc)):
                    del compute
                    raise
            finally:
                # The frame would otherwise sit in a cycle (task -> exception -> traceback ->
                # this frame -> task) that keeps a large request alive until the next
                # collection.
                del task
