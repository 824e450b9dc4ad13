"""EvictableHeap: the evictable leaves of an index, ordered by the eviction policy's key.

Entries are pushed when they become evictable leaves (or, unless the policy's keys only grow,
when they are touched while they are one) and invalidated lazily: each entry carries a version,
bumped on every push/discard, and stale heap items are skipped on pop; an out-of-date key is
refreshed when its item reaches the top. Each operation is O(log n); the heap is compacted
when stale items outnumber live ones, so memory stays O(live entries).

A key is re-asked only when it can be out of date: each item records its entry's ``tick``
when keyed, and the top's key is re-checked only if the entry was touched since (its
``tick`` moved). A policy whose keys move without a touch (``experts`` switching experts)
bumps its ``key_epoch``; the heap then re-keys every live entry once.
"""

from __future__ import annotations

import heapq
from typing import Any, Protocol

from prefixkv.cache.policies import EvictionPolicy


class HeapEntry(Protocol):
    """What the heap needs from an entry: a version slot, a membership flag, its last touch."""

    heap_ver: int
    in_heap: bool
    tick: int


# an item: (head, key, push sequence number, entry's heap_ver, entry's tick when keyed, entry)
_Item = tuple[Any, Any, int, int, int, Any]


def _head(key: Any) -> Any:
    """A key's first component (the key itself if it is not a tuple), put before the key in
    each item: items then compare two floats, not two nested tuples, unless the heads tie
    (then the whole keys, so the order is the keys' own). A heap pop compares about twenty
    items; with the shipped keys this takes a pop from 1.8 to about 1 us at 1,000 leaves."""
    return key[0] if type(key) is tuple and key else key


class EvictableHeap:
    """A lazy-deletion min-heap keyed by ``policy.key(entry)``."""

    __slots__ = ("_epoch", "_heap", "_keeps", "_live", "_seq", "policy")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[_Item] = []
        self._seq = 0
        self._live = 0
        self._epoch = policy.key_epoch
        self._keeps = policy.monotone_keys and policy.depth_monotone_keys

    def __len__(self) -> int:
        return self._live

    def push(self, entry: Any) -> None:
        """Insert ``entry`` or refresh its key.

        Under a policy declaring both ``monotone_keys`` and ``depth_monotone_keys``, an entry
        already in the heap keeps its item: its key moves only with a touch (its ``tick``,
        re-checked at the top) or the policy's ``key_epoch``, and reads its blocks only through
        ``depth``, which a split leaves unchanged for the lower part (the re-files an index
        makes of an entry in the heap are those splits). No stale item is left behind.
        """
        if entry.in_heap:
            if self._keeps:
                return
            self._live -= 1
        entry.heap_ver += 1
        entry.in_heap = True
        self._live += 1
        self._seq += 1
        key = self.policy.key(entry)
        heapq.heappush(self._heap, (_head(key), key, self._seq, entry.heap_ver,
                                    entry.tick, entry))
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
        lower bound, so an item whose entry was touched since it was keyed is re-keyed here,
        when it reaches the top, and re-pushed if its key moved. The top is then the true
        minimum: every other entry's key is at least its stored key, which is at least the
        top's. (A key that reads policy state other than the entry's own record, such as a
        running mean gap, is as of the entry's last touch.)
        """
        if self.policy.key_epoch != self._epoch:
            self._rekey()
        heap = self._heap
        while heap:
            _, stored, _, ver, tick, entry = heap[0]
            if not (entry.in_heap and ver == entry.heap_ver):
                heapq.heappop(heap)
                continue
            if tick == entry.tick:
                return True
            current = self.policy.key(entry)
            entry.heap_ver += 1
            self._seq += 1
            if current == stored:  # still the top: record the touch, keep its place
                heap[0] = (heap[0][0], stored, heap[0][2], entry.heap_ver, entry.tick, entry)
                return True
            heapq.heapreplace(heap, (_head(current), current, self._seq, entry.heap_ver,
                                     entry.tick, entry))
        return False

    def pop(self) -> Any | None:
        """Remove and return the entry with the smallest key, or ``None`` if empty."""
        if not self._settle_top():
            return None
        entry = heapq.heappop(self._heap)[5]
        entry.in_heap = False
        entry.heap_ver += 1
        self._live -= 1
        return entry

    def pop_and_peek(self) -> tuple[Any | None, Any | None]:
        """:meth:`pop`, then :meth:`peek_key` (one call: the eviction loop's step)."""
        if not self._settle_top():
            return None, None
        heap = self._heap
        entry = heapq.heappop(heap)[5]
        entry.in_heap = False
        entry.heap_ver += 1
        self._live -= 1
        if heap:  # the common case, settled here: the next item is live and untouched (no
            top = heap[0]  # key was asked since the settle above, so the epoch stands)
            nxt = top[5]
            if nxt.in_heap and top[3] == nxt.heap_ver and top[4] == nxt.tick:
                return entry, top[1]
        return entry, heap[0][1] if self._settle_top() else None

    def peek_key(self) -> Any | None:
        """The smallest live key, or ``None`` if empty."""
        return self._heap[0][1] if self._settle_top() else None

    def _rekey(self) -> None:
        """Re-key every live entry (the policy's keys moved: ``key_epoch``); O(n)."""
        self._epoch = self.policy.key_epoch
        key = self.policy.key
        items = []
        for it in self._heap:
            entry = it[5]
            if entry.in_heap and it[3] == entry.heap_ver:
                entry.heap_ver += 1
                self._seq += 1
                k = key(entry)
                items.append((_head(k), k, self._seq, entry.heap_ver, entry.tick, entry))
        heapq.heapify(items)
        self._heap = items

    def _compact(self) -> None:
        self._heap = [it for it in self._heap if it[5].in_heap and it[3] == it[5].heap_ver]
        heapq.heapify(self._heap)
