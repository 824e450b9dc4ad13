"""Protection: path-wide lock and pin counts, and the evictable-leaf heap they gate.

Locking (or pinning) an entry increments ``lock_ref`` (``pin_ref``) on it and on every
ancestor, so an entry whose counts are zero has no locked or pinned descendant and evicting
leaves can never strand a protected block. Block counts of locked, pinned and *protected*
(either) entries are kept as the counts cross zero, so an index knows in O(1) how many blocks
it could evict. An entry is in the heap exactly when it is an evictable leaf: unprotected, no
children, holding blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixkv.cache.evictable import EvictableHeap
from prefixkv.cache.policies import EvictionPolicy

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

    __slots__ = ("heap", "locked_blocks", "pinned_blocks", "protected_blocks")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.heap = EvictableHeap(policy)
        self.locked_blocks = 0
        self.pinned_blocks = 0
        self.protected_blocks = 0

    def refresh(self, e: Entry | None) -> None:
        """Re-file ``e`` in the heap after anything about it changed (key or evictability)."""
        if e is None or e.is_root:
            return
        if is_evictable_leaf(e) and e.num_blocks:
            self.heap.push(e)
        else:
            self.heap.discard(e)

    def add_lock(self, target: Entry, delta: int) -> None:
        """Lock (``+1``) or unlock (``-1``) ``target`` and its ancestors."""
        for e in path_up(target):
            before = e.lock_ref
            e.lock_ref = before + delta
            if (before == 0) != (e.lock_ref == 0):
                sign = 1 if delta > 0 else -1
                self.locked_blocks += sign * e.num_blocks
                if e.pin_ref == 0:
                    self.protected_blocks += sign * e.num_blocks
                self.refresh(e)

    def add_pin(self, target: Entry, delta: int) -> None:
        """Pin (``+1``) or unpin (``-1``) ``target`` and its ancestors."""
        for e in path_up(target):
            before = e.pin_ref
            e.pin_ref = before + delta
            if (before == 0) != (e.pin_ref == 0):
                sign = 1 if delta > 0 else -1
                self.pinned_blocks += sign * e.num_blocks
                if e.lock_ref == 0:
                    self.protected_blocks += sign * e.num_blocks
                self.refresh(e)

    def new_pinned_blocks(self, target: Entry) -> int:
        """Blocks that pinning ``target`` would newly pin (for the budget check)."""
        return sum(e.num_blocks for e in path_up(target) if e.pin_ref == 0)
