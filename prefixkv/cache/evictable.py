"""EvictableHeap: the evictable leaves of an index, ordered by the eviction policy's key.

Entries are pushed when they become evictable leaves (or, unless the policy's keys only grow,
when they are touched while they are one) and invalidated lazily: each entry carries a version,
bumped on every push/discard, and stale heap items are skipped on pop; an out-of-date key is
refreshed when its item reaches the top. Each operation is O(log n); the heap is compacted when stale items
outnumber live ones, so memory stays O(live entries).

The top, once settled (live, its key re-checked), stays settled until the heap changes, its
entry is touched (its ``tick`` moves) or the policy says its keys moved (``key_epoch``): an
eviction's ``pop`` after a ``peek_key`` does not ask the policy again.
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

    __slots__ = ("_epoch", "_heap", "_live", "_seq", "_top", "_top_tick", "policy")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[Any, int, int, Any]] = []
        self._seq = 0
        self._live = 0
        # the settled top item (None: not known), its entry's tick then, the policy's epoch
        self._top: tuple[Any, int, int, Any] | None = None
        self._top_tick = 0
        self._epoch = policy.key_epoch

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
        if self.policy.key_epoch != self._epoch:
            self._rekey()
        heap = self._heap
        if heap and heap[0] is self._top:
            entry = heap[0][3]
            if entry.tick == self._top_tick and entry.in_heap and heap[0][2] == entry.heap_ver:
                return True
        key = self.policy.key
        while heap:
            stored, _, ver, entry = heap[0]
            if not (entry.in_heap and ver == entry.heap_ver):
                heapq.heappop(heap)
                continue
            current = key(entry)
            if current == stored:
                self._top, self._top_tick = heap[0], entry.tick
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

    def _rekey(self) -> None:
        """Re-key every live entry (the policy's keys moved: ``key_epoch``); O(n)."""
        self._epoch = self.policy.key_epoch
        key = self.policy.key
        live = [it[3] for it in self._heap if it[3].in_heap and it[2] == it[3].heap_ver]
        self._heap = []
        for entry in live:
            entry.heap_ver += 1
            self._seq += 1
            self._heap.append((key(entry), self._seq, entry.heap_ver, entry))
        heapq.heapify(self._heap)
        self._top = None

    def _compact(self) -> None:
        self._heap = [it for it in self._heap if it[3].in_heap and it[2] == it[3].heap_ver]
        heapq.heapify(self._heap)
