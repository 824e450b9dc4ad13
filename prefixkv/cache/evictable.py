"""EvictableHeap: the evictable leaves of an index, ordered by the eviction policy's key.

Entries are pushed when they become evictable leaves (or, unless the policy's keys only grow,
when they are touched while they are one) and invalidated lazily: each entry carries a version,
bumped on every push/discard, and stale heap items are skipped on pop; an out-of-date key is
refreshed when its item reaches the top. Each operation is O(log n); the heap is compacted
when stale items outnumber live ones, so memory stays O(live entries).

An item is the key's items followed by ``(push sequence number, entry's heap_ver, entry's tick
when keyed, entry)`` while every key is a tuple of one length (the shipped LRU, LFU and FIFO
keys): one flat tuple, 56 bytes less per leaf than a key tuple inside an item tuple, and the
same order (tuples of equal length compare item by item). The first key that is not such a
tuple turns every item into ``(head, key, seq, ver, tick, entry)`` for good (O(n), once).

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


# an item: (*key, seq, ver, tick, entry) or (head, key, seq, ver, tick, entry) (module doc)
_Item = tuple[Any, ...]


def _head(key: Any) -> Any:
    """A key's first component (the key itself if it is not a tuple), put before the key in
    each item: items then compare two floats, not two nested tuples, unless the heads tie
    (then the whole keys, so the order is the keys' own). A heap pop compares about twenty
    items; with the shipped keys this takes a pop from 1.8 to about 1 us at 1,000 leaves."""
    return key[0] if type(key) is tuple and key else key


class EvictableHeap:
    """A lazy-deletion min-heap keyed by ``policy.key(entry)``."""

    __slots__ = ("_epoch", "_flat", "_heap", "_keeps", "_live", "_seq", "policy")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[_Item] = []
        self._seq = 0
        self._live = 0
        self._epoch = policy.key_epoch
        self._keeps = policy.monotone_keys and policy.depth_monotone_keys
        self._flat = -1  # the flat items' key length; -1 until the first key, 0: nested items

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
        item = self._item(self.policy.key(entry), entry)  # (may nest the heap: read it after)
        heapq.heappush(self._heap, item)
        if len(self._heap) > 2 * self._live + 64:
            self._compact()

    def _item(self, key: Any, entry: Any) -> _Item:
        """The heap item of ``entry`` keyed ``key`` (its sequence number already taken)."""
        flat = self._flat
        if flat and type(key) is tuple:
            if len(key) == flat:
                return key + (self._seq, entry.heap_ver, entry.tick, entry)
            if flat < 0 and key:
                self._flat = len(key)
                return key + (self._seq, entry.heap_ver, entry.tick, entry)
        if flat:
            self._nest()
        return (_head(key), key, self._seq, entry.heap_ver, entry.tick, entry)

    def _key(self, item: _Item) -> Any:
        """The key an item was filed under."""
        return item[:-4] if self._flat > 0 else item[1]

    def _nest(self) -> None:
        """Items ``(head, key, seq, ver, tick, entry)`` from now on (a key that is not a tuple
        of the flat items' length arrived); the order does not change."""
        if self._flat > 0:
            self._heap = [(_head(it[:-4]), it[:-4], *it[-4:]) for it in self._heap]
        self._flat = 0

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
            top = heap[0]
            entry = top[-1]
            if not (entry.in_heap and top[-3] == entry.heap_ver):
                heapq.heappop(heap)
                continue
            if top[-2] == entry.tick:
                return True
            current = self.policy.key(entry)
            entry.heap_ver += 1
            self._seq += 1
            if current == self._key(top):  # still the top: record the touch, keep its place
                heap[0] = top[:-3] + (entry.heap_ver, entry.tick, entry)
                return True
            item = self._item(current, entry)
            heapq.heapreplace(self._heap, item)  # (a nested heap is a new list)
            heap = self._heap
        return False

    def pop(self) -> Any | None:
        """Remove and return the entry with the smallest key, or ``None`` if empty."""
        if not self._settle_top():
            return None
        entry = heapq.heappop(self._heap)[-1]
        entry.in_heap = False
        entry.heap_ver += 1
        self._live -= 1
        return entry

    def pop_and_peek(self) -> tuple[Any | None, Any | None]:
        """:meth:`pop`, then :meth:`peek_key` (one call: the eviction loop's step)."""
        if not self._settle_top():
            return None, None
        heap = self._heap
        entry = heapq.heappop(heap)[-1]
        entry.in_heap = False
        entry.heap_ver += 1
        self._live -= 1
        if heap:  # the common case, settled here: the next item is live and untouched (no
            top = heap[0]  # key was asked since the settle above, so the epoch stands)
            nxt = top[-1]
            if nxt.in_heap and top[-3] == nxt.heap_ver and top[-2] == nxt.tick:
                return entry, self._key(top)
        return entry, self._key(self._heap[0]) if self._settle_top() else None

    def peek_key(self) -> Any | None:
        """The smallest live key, or ``None`` if empty."""
        return self._key(self._heap[0]) if self._settle_top() else None

    def _rekey(self) -> None:
        """Re-key every live entry (the policy's keys moved: ``key_epoch``); O(n)."""
        self._epoch = self.policy.key_epoch
        key = self.policy.key
        live = [it[-1] for it in self._heap if it[-1].in_heap and it[-3] == it[-1].heap_ver]
        self._heap = []
        for entry in live:
            entry.heap_ver += 1
            self._seq += 1
            item = self._item(key(entry), entry)  # (may nest the items so far: read the heap after)
            self._heap.append(item)
        heapq.heapify(self._heap)

    def _compact(self) -> None:
        self._heap = [it for it in self._heap if it[-1].in_heap and it[-3] == it[-1].heap_ver]
        heapq.heapify(self._heap)
