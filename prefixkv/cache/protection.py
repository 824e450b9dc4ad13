"""Protection: path-wide lock and pin counts, and the evictable-leaf heap they gate.

Locking (or pinning) an entry increments ``lock_ref`` (``pin_ref``) on it and on every
ancestor, so an entry whose counts are zero has no locked or pinned descendant and evicting
leaves can never strand a protected block. Block counts of locked, pinned and *protected*
(either) entries are kept as the counts cross zero, so an index knows in O(1) how many blocks
it could evict. An entry is in the heap exactly when it is an evictable leaf: unprotected, no
children, holding blocks, and no live soft retention: a retained evictable leaf is filed in
the :class:`~prefixkv.cache.retention.RetainedSet` beside the heap instead.
:meth:`Protection.touch` records an access (renewing retentions) and keeps that true.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prefixkv.cache.evictable import EvictableHeap
from prefixkv.cache.policies import EvictionPolicy
from prefixkv.cache.retention import RetainedSet

if TYPE_CHECKING:
    from prefixkv.cache.forest import Entry


def is_evictable_leaf(e: Entry) -> bool:
    """Unlocked, unpinned, childless, and not a root sentinel."""
    return e.lock_ref == 0 and e.pin_ref == 0 and e.num_children == 0 and not e.is_root


def path_up(e: Entry | None) -> list[Entry]:
    """``e`` and its ancestors, deepest first, without the root sentinel."""
    out = []
    while e is not None and not e.is_root:
        out.append(e)
        e = e.parent
    return out


class Protection:
    """Lock/pin accounting for one index (guarded by the index's lock)."""

    __slots__ = ("_access_hook", "_tick", "heap", "locked_blocks", "pinned_blocks",
                 "protected_blocks", "retained")

    def __init__(self, policy: EvictionPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.heap = EvictableHeap(policy)
        self.retained = RetainedSet(policy, clock, self.refresh)
        self.locked_blocks = 0
        self.pinned_blocks = 0
        self.protected_blocks = 0
        self._tick = 0
        self._access_hook = type(policy).on_access is not EvictionPolicy.on_access

    def touch(self, entries: Sequence[Entry], now: float) -> None:
        """A match or insert reached ``entries`` (a path, shallowest first): record the access
        (time, count, tick; the policy's ``on_access``) and re-file the path's leaf."""
        self._tick += 1
        tick = self._tick
        for e in entries:
            e.last_access_time = now
            e.access_count += 1
            e.tick = tick
        policy = self.heap.policy
        if self._access_hook:
            for e in entries:
                policy.on_access(e)
        if self.retained.blocks:  # a hit renews the retentions it reaches
            self.retained.renew(entries, now)
        # Only the last entry of a path can be a leaf. A new leaf joins the heap here; one
        # already in it is re-filed, unless keys are monotone: then its stored key stays a valid
        # lower bound and the heap refreshes it lazily.
        if entries:
            last = entries[-1]
            if last.in_heap:
                if not policy.monotone_keys:
                    self.refresh(last)
            elif is_evictable_leaf(last):
                self.refresh(last)

    def refresh(self, e: Entry | None) -> None:
        """Re-file ``e`` in the heap after anything about it changed (key or evictability)."""
        if e is None or e.is_root:
            return
        if is_evictable_leaf(e) and e.num_blocks:
            if e.retention is not None and self.retained.hold(e):
                self.heap.discard(e)  # retained: evicted after the heap's leaves
                return
            self.heap.push(e)
        else:
            self.heap.discard(e)
            if e.retention is not None:
                self.retained.discard(e)

    def add_lock(self, target: Entry, delta: int) -> None:
        """Lock (``+1``) or unlock (``-1``) ``target`` and its ancestors."""
        for e in path_up(target):
            before = e.lock_ref
            e.lock_ref = before + delta
            if (before == 0) != (e.lock_ref == 0):
                self._crossed(e, delta, other=e.pin_ref)
                self.locked_blocks += (1 if delta > 0 else -1) * e.num_blocks

    def add_pin(self, target: Entry, delta: int) -> None:
        """Pin (``+1``) or unpin (``-1``) ``target`` and its ancestors."""
        for e in path_up(target):
            before = e.pin_ref
            e.pin_ref = before + delta
            if (before == 0) != (e.pin_ref == 0):
                self._crossed(e, delta, other=e.lock_ref)
                self.pinned_blocks += (1 if delta > 0 else -1) * e.num_blocks

    def _crossed(self, e: Entry, delta: int, other: int) -> None:
        """One of ``e``'s counts crossed zero: it is protected by it alone unless ``other``."""
        if other == 0:
            self.protected_blocks += (1 if delta > 0 else -1) * e.num_blocks
        self.refresh(e)

    def new_pinned_blocks(self, target: Entry) -> int:
        """Blocks that pinning ``target`` would newly pin (for the budget check)."""
        return sum(e.num_blocks for e in path_up(target) if e.pin_ref == 0)

    def check(self, entries: Sequence[Entry]) -> set[int]:
        """Assert the counts and the heap agree with ``entries`` (every entry of the index);
        returns the block ids they hold (asserting none is held twice)."""
        seen: set[int] = set()
        locked = pinned = protected = 0
        for e in entries:
            n = e.num_blocks
            for b in e.blocks:
                assert b not in seen, f"block {b} cached twice"
                seen.add(b)
            if e.parent is not None and not e.parent.is_root:
                assert e.lock_ref <= e.parent.lock_ref and e.pin_ref <= e.parent.pin_ref
            locked += n if e.lock_ref else 0
            pinned += n if e.pin_ref else 0
            protected += n if (e.lock_ref or e.pin_ref) else 0
            assert e.in_heap == (is_evictable_leaf(e) and e.retention is None), "heap out of sync"
        assert (locked, pinned, protected) == (
            self.locked_blocks, self.pinned_blocks, self.protected_blocks)
        self.retained.check(entries, is_evictable_leaf)
        return seen
