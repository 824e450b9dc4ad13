"""EvictableHeap: the evictable leaves of an index, ordered by the eviction policy's key.

Entries are pushed when they become evictable leaves (or, unless the policy's keys only grow,
when they are touched while they are one) and invalidated lazily: each entry carries a version,
bumped on every push/discard, and stale heap items are skipped on pop; an out-of-date key is
refreshed when its item reaches the top. Each operation is O(log n); the heap is compacted when stale items
outnumber live ones, so memory stays O(live entries).
"""

from __future__ import annotations

import heapq
from typing import Any, Protocol

from prefixkv.cache.policies import EvictionPolicy


class HeapEntry(Protocol):
    """What the heap needs from an entry: a version slot and a membership flag."""

    heap_ver: int
    in_heap: bool


class EvictableHeap:
    """A lazy-deletion min-heap keyed by ``policy.key(entry)``."""

    __slots__ = ("_heap", "_live", "_seq", "policy")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[Any, int, int, Any]] = []
        self._seq = 0
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, entry: Any) -> None:
        """Insert ``entry`` or refresh its key."""
        if entry.in_heap:
            self._live -= 1
        entry.heap_ver += 1
        entry.in_heap = True
        self._live += 1
        self._seq += 1
        heapq.heappush(self._heap, (self.policy.key(entry), self._seq, entry.heap_ver, entry))
        if len(self._heap) > 2 * self._live + 64:
            self._compact()

    def discard(self, entry: Any) -> None:
        """Remove ``entry`` if present (lazily)."""
        if entry.in_heap:
            entry.in_heap = False
            entry.heap_ver += 1
            self._live -= 1

    def _settle_top(self) -> bool:
        """Make the top item live and up to date; ``False`` if the heap is empty.

        Stale items (discarded or re-pushed) are dropped. With a policy whose keys only grow
        (``monotone_keys``), a touched entry is not re-pushed when touched: its stored key is a
        lower bound, so an item whose stored key is out of date is re-pushed here, when it
        reaches the top. The top is then the true minimum: every other entry's key is at least
        its stored key, which is at least the top's.
        """
        heap = self._heap
        key = self.policy.key
        while heap:
            stored, _, ver, entry = heap[0]
            if not (entry.in_heap and ver == entry.heap_ver):
                heapq.heappop(heap)
                continue
            current = key(entry)
            if current == stored:
                return True
            entry.heap_ver += 1
            self._seq += 1
            heapq.heapreplace(heap, (current, self._seq, entry.heap_ver, entry))
        return False

    def pop(self) -> Any | None:
        """Remove and return the entry with the smallest key, or ``None`` if empty."""
        if not self._settle_top():
            return None
        entry = heapq.heappop(self._heap)[3]
        entry.in_heap = False
        entry.heap_ver += 1
        self._live -= 1
        return entry

    def peek_key(self) -> Any | None:
        """The smallest live key, or ``None`` if empty."""
        return self._heap[0][0] if self._settle_top() else None

    def _compact(self) -> None:
        self._heap = [it for it in self._heap if it[3].in_heap and it[2] == it[3].heap_ver]
        heapq.heapify(self._heap)
