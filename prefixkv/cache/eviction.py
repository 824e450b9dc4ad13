"""Evictor: which blocks ``evict(n)`` frees, and in what order (guarded by the index's lock).

The order is the block-by-block one: pop the policy's smallest evictable leaf, trim its deepest
block, re-file it, repeat (vLLM's tail-first rule falls out of the shipped keys, which put the
deeper entry first on ties). Two shortcuts give the same ids in the same order, checked by a
property test against the block-by-block loop:

* a *run*: with a ``depth_monotone_keys`` policy (LRU, LFU, FIFO) a leaf's key only grows as its
  tail is trimmed, so the number of tail blocks it gives up before any other leaf's is found by
  a binary search over key probes at smaller depths, and freed in one step (a whole node, or
  one cut): O(log blocks) Python work per leaf, not O(blocks);
* a *parent next*: a parent left childless would be filed and popped next exactly when its key
  is below the heap's smallest (a tie goes to the older heap item), so it is taken directly.

The common step (a radix index, a policy whose keys lead with a component that does not depend
on depth, no ``on_evict`` hook) runs in C when the helper is built (``whole``); the loop here
takes over at the first step that is not common (a key tie, a stale top, a parent to decide).
Policies without the declaration keep the block-by-block loop. Retained leaves (soft retention,
:mod:`prefixkv.cache.retention`) are not in the heap: only when it is empty does a call go on
with them, a whole entry (or the tail still wanted) per step, lowest priority first. So a call costs O(leaves
touched x log n) steps (in C, or in Python: one heap call, one key probe and one detach per
whole leaf) plus the C-speed work on the freed ids: each entry's id array is appended to the
result (``array('I')``, joined and reversed in one pass). Releasing them is O(1) per entry that leaves whole and holds its
owner tag alone (:meth:`~prefixkv.cache.held_ids.HeldIds.release_owner`); trimmed tails (at most
one a call with a run policy) and hashed blocks (no tag of their own) are released id by id,
once, at the end.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from prefixkv.cache._native import keypack as _keypack  # None: the Python path
from prefixkv.cache.evictable import EvictableHeap
from prefixkv.cache.held_ids import BULK, ID_TYPECODE, BlockIds, new_ids
from prefixkv.cache.policies import EvictionPolicy
from prefixkv.cache.retention import RetainedSet

if TYPE_CHECKING:
    from prefixkv.cache.forest import Entry

E = TypeVar("E", bound="Entry")

WholeLeaves = Callable[[int, int, list[BlockIds], list[BlockIds]], tuple[int, int, Any]]
"""``whole(want, got, runs, loose) -> (got, entries_freed, orphan)``: frees evictable leaves
in the policy's order while each step is a common one (``prefixkv/cache/_evict.c``: the top and
next heap items live and untouched; when more than one block goes, the top key's first component
strictly below the next one's), whole or, for the call's last step, the tail still wanted,
appending each id run to ``runs`` (and to ``loose`` when it is a tail or its owner tag is
shared) exactly as this module's loop would; stops at the first other step, or returns the
freed leaf whose parent is left a childless non-root (``orphan``)."""

_ONE_ID = array(ID_TYPECODE, [0])
"""The unit the C join repeats into its result (an ``array('I')`` of the freed ids' length)."""

_UNKNOWN: Any = object()
"""A ``top`` to ask the heap for (keys may have moved, or C freed the last leaf)."""


class _AtDepth:
    """``entry`` as it would be with its deepest blocks trimmed to ``depth`` (a key probe)."""

    __slots__ = ("_entry", "depth")

    def __init__(self, entry: Any, depth: int) -> None:
        self._entry = entry
        self.depth = depth

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)


def key_at_depth(policy: EvictionPolicy, entry: Any, depth: int) -> Any:
    """``policy.key`` of ``entry`` as if its blocks below ``depth`` were gone (any entry type;
    the radix index overrides its probe with a cheaper one)."""
    return policy.key(_AtDepth(entry, depth))


class Evictor(Generic[E]):
    """Frees blocks of one index in policy order through the index's own operations.

    Args:
        heap: the index's evictable leaves.
        policy: its eviction policy.
        drop_tail: ``drop_tail(entry, k)`` removes an evictable leaf's last ``k`` blocks (and
            detaches it when empty); returns their ids shallowest first (as stored).
        release: ``release(ids)``, the index stops holding dropped ids one by one (called at
            most once a call, for the trimmed tails and untagged entries).
        release_owner: ``release_owner(owner, ids)``, the index stops holding the ids of an
            entry that left whole (``entry.owner``, non-zero; O(1) unless a split part of the
            entry still shares the tag).
        key_at: ``key_at(entry, depth)``, the policy's key at a smaller depth (a probe).
        refresh: re-files an entry in the heap after it changed (its children, its blocks).
        gone: called for each entry whose last block was evicted, before anything else moves
            (the policy's ``on_evict``), or ``None``.
        whole: the forest's C runner of common whole-leaf steps (:data:`WholeLeaves`), or
            ``None`` (used only without ``gone``).
        retained: the retained leaves, evicted once the heap is empty (or ``None``).

    ``entries_freed`` counts the entries the last call removed whole (it stays correct when a
    ``gone`` hook raises: what was removed before is counted).
    """

    __slots__ = ("_drop_tail", "_gone", "_heap", "_key_at", "_policy", "_refresh", "_release",
                 "_release_owner", "_retained", "_whole", "entries_freed")

    def __init__(self, heap: EvictableHeap, policy: EvictionPolicy, *,
                 drop_tail: Callable[[E, int], BlockIds],
                 release: Callable[[BlockIds], None],
                 release_owner: Callable[[int, BlockIds], None],
                 key_at: Callable[[E, int], Any], refresh: Callable[[Entry | None], None],
                 gone: Callable[[E], None] | None, whole: WholeLeaves | None = None,
                 retained: RetainedSet | None = None) -> None:
        self._heap = heap
        self._retained = retained
        self._whole = whole if gone is None else None
        self._policy = policy
        self._drop_tail = drop_tail
        self._release = release
        self._release_owner = release_owner
        self._key_at = key_at
        self._refresh = refresh
        self._gone = gone
        self.entries_freed = 0

    def evict(self, num_blocks: int) -> BlockIds:
        """Free up to ``num_blocks`` blocks; returns their ids (fewer if fewer are evictable):
        the dropped runs in eviction order, each deepest block first."""
        runs: list[BlockIds] = []
        loose: list[BlockIds] = []  # dropped runs still stamped with a live owner
        self.entries_freed = 0
        try:
            got = self._evict(num_blocks, runs, loose, 0)
            retained = self._retained
            while got < num_blocks and retained:  # the heap is empty: retained leaves next
                before = got
                got = self._evict_retained(num_blocks, got, runs, loose)
                if got == before:
                    break
                if got < num_blocks and len(self._heap):  # a parent decayed to the policy
                    got = self._evict(num_blocks, runs, loose, got)
        finally:  # every id dropped from the forest is released, even if a hook raised
            out = self._released(runs, loose)
        return out

    def _released(self, runs: list[BlockIds], loose: list[BlockIds]) -> BlockIds:
        """The freed ids in order; releases the ``loose`` runs (the others left through their
        owner tags)."""
        out = deepest_first(runs)
        if len(loose) == len(runs):
            self._release(out)
        elif len(loose) == 1:
            self._release(loose[0])
        elif loose:
            ids = new_ids()
            ids.frombytes(b"".join(loose))
            self._release(ids)
        return out

    def evict_among(self, entries: Iterable[E], num_blocks: int) -> BlockIds:
        """Free up to ``num_blocks`` blocks of ``entries`` (a tenant's, over its quota): its
        evictable leaves in the policy's order, a whole leaf (or the tail still wanted) per
        step, then the parents they leave as evictable leaves. Retained leaves are not taken."""
        key, heap, refresh = self._policy.key, self._heap, self._refresh
        todo = [(key(e), i, e) for i, e in enumerate(entries) if e.in_heap]
        heapq.heapify(todo)
        seq = len(todo)
        runs: list[BlockIds] = []
        loose: list[BlockIds] = []
        got = 0
        self.entries_freed = 0
        try:
            while got < num_blocks and todo:
                e = heapq.heappop(todo)[2]
                if not e.in_heap:
                    continue
                heap.discard(e)
                n: int = e.num_blocks
                k = min(num_blocks - got, n)
                run = self._drop_tail(e, k)
                runs.append(run)
                got += k
                if k < n or not e.owner:
                    loose.append(run)
                else:
                    self._release_owner(e.owner, run)
                if k < n:
                    refresh(e)
                    break
                self.entries_freed += 1
                if self._gone is not None:
                    self._gone(e)
                parent = e.parent
                refresh(parent)
                if parent is not None and parent.in_heap:
                    seq += 1
                    heapq.heappush(todo, (key(parent), seq, parent))
        finally:
            out = self._released(runs, loose)
        return out

    def _evict(self, num_blocks: int, out: list[BlockIds], loose: list[BlockIds], got: int) -> int:
        heap = self._heap
        pop_and_peek, push = heap.pop_and_peek, heap.push
        drop_tail, gone, key_at = self._drop_tail, self._gone, self._key_at
        release_owner, whole = self._release_owner, self._whole
        runs = self._policy.depth_monotone_keys
        e: E | None = None
        top: Any = None  # the heap's smallest key while e is out of it
        while got < num_blocks:
            if e is None:
                if whole is not None:  # the common steps in C, then the first other one here
                    got, freed, orphan = whole(num_blocks, got, out, loose)
                    self.entries_freed += freed
                    if orphan is not None:
                        e, top = self._parent_next(orphan, got < num_blocks, _UNKNOWN)
                        continue
                    if got >= num_blocks:
                        break
                e, top = pop_and_peek()
                if e is None:
                    break
            if runs:
                n = e.num_blocks
                k = num_blocks - got
                if k > n:
                    k = n
                # the whole run unless e's key at its shallowest kept depth is above the next
                # leaf's (then: a binary search)
                if k > 1 and top is not None and key_at(e, e.depth - (k - 1)) > top:
                    k = self._run_length(e, k, top)
                run = drop_tail(e, k)
                out.append(run)
                got += k
                left = k < n
                owner = e.owner
                if left or not owner:
                    loose.append(run)
                else:  # the entry left whole: released through its tag
                    release_owner(owner, run)
            else:
                before = len(out)
                got = self._trim_per_block(e, num_blocks, out, got)
                left = e.num_blocks > 0
                if left or not e.owner:
                    loose.extend(out[before:])
                else:  # its last block left with it: released through its tag
                    loose.extend(out[before:-1])
                    release_owner(e.owner, out[-1])
            if left:
                push(e)
                e = None
                continue
            self.entries_freed += 1
            if gone is not None:
                gone(e)
            e, top = self._parent_next(e, runs and got < num_blocks,
                                       top if gone is None else _UNKNOWN)
        return got

    def _evict_retained(self, num_blocks: int, got: int, out: list[BlockIds],
                        loose: list[BlockIds]) -> int:
        """Evict the tail of the first retained leaf (all of it, or what the call still
        wants); returns the new count of freed ids."""
        retained = self._retained
        assert retained is not None
        e = retained.pop()
        if e is None:
            return got
        n: int = e.num_blocks
        k = min(num_blocks - got, n)
        run = self._drop_tail(e, k)
        out.append(run)
        retained.dropped(e, k, whole=k == n)
        if k < n or not e.owner:
            loose.append(run)
        else:
            self._release_owner(e.owner, run)
        if k < n:
            self._refresh(e)  # back among the retained leaves
            return got + k
        self.entries_freed += 1
        if self._gone is not None:
            self._gone(e)
        self._refresh(e.parent)  # a leaf now: the heap, or the retained leaves
        return got + k

    def _parent_next(self, e: E, more: bool, top: Any) -> tuple[E | None, Any]:
        """After ``e`` left whole: its parent and the heap's smallest key when the parent, left
        a childless leaf, would be popped next (``more``: a run policy still wanting blocks),
        else ``(None, top)`` with the parent re-filed. ``top`` is the heap's smallest key, or
        ``_UNKNOWN`` when a hook may have moved keys (or C freed ``e``): asked then."""
        parent = e.parent
        # a parent left with children is unchanged (not a leaf, so not in the heap)
        if parent is None or parent.num_children or parent.is_root:
            return None, top
        if (more and parent.num_blocks and parent.lock_ref == 0 and parent.pin_ref == 0
                and parent.retention is None):
            if top is _UNKNOWN:
                top = self._heap.peek_key()
            if top is None or self._policy.key(parent) < top:  # it would be popped next
                return parent, top
        self._refresh(parent)
        return None, top

    def _run_length(self, e: E, k: int, top: Any) -> int:
        """How many of ``e``'s last ``k`` blocks go before any other leaf's (at least one, fewer
        than ``k``: ``e``'s key with ``k - 1`` blocks dropped is above ``top``, the heap's
        smallest key).

        Dropping ``j`` tail blocks leaves ``e`` at depth ``depth - j``; the per-block order
        takes block ``j + 1`` while ``e``'s key at that depth is <= the heap's smallest key.
        Keys only grow as the depth shrinks, so the answer is found by binary search.
        """
        key_at, depth = self._key_at, e.depth
        lo, hi = 0, k - 1  # the key after dropping lo blocks is <= top, after hi it is not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if key_at(e, depth - mid) <= top:
                lo = mid
            else:
                hi = mid
        return lo + 1

    def _trim_per_block(self, e: E, num_blocks: int, out: list[BlockIds], got: int) -> int:
        """Trim ``e`` one block at a time while it stays the policy's choice (its key may change
        with its tail block: a per-block policy state); returns the new count of freed ids."""
        heap, key = self._heap, self._policy.key
        while True:
            out.append(self._drop_tail(e, 1))
            got += 1
            if not e.num_blocks or got >= num_blocks:
                return got
            top = heap.peek_key()
            if top is not None and key(e) > top:
                return got


def deepest_first(runs: list[BlockIds]) -> BlockIds:
    """The runs (each shallowest first, as stored) concatenated in order, each reversed.

    One C pass when the helper is built. Else: ``reversed(R1 + ... + Rk)`` is ``rev(Rk) + ...
    + rev(R1)``, so the runs are joined in reverse order and the whole reversed once, in numpy
    (an ``array`` reverses item by item, several times slower); a few ids take a plain loop.
    """
    if len(runs) == 1 and len(runs[0]) <= 1:
        return runs[0]
    if _keypack is not None:  # one C pass into the result (10,240 ids: 1.3 us, 5 in numpy)
        joined: BlockIds = _keypack.reversed_runs(runs, _ONE_ID)
        return joined
    out = new_ids()
    total = sum(map(len, runs))
    if total < BULK:
        for r in runs:
            out += r[::-1]
        return out
    joined = b"".join(reversed(runs))
    out.frombytes(np.frombuffer(joined, dtype=np.uint32)[::-1].tobytes())
    return out
