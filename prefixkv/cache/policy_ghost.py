"""GhostPolicy: LRU plus a lifetime bonus for prefixes that were requested before.

Why (issue 5's study of the Mooncake conversation trace): a chat conversation that already came
back is far more likely to come back again (30% of first turns get a next turn, 50-75% of
later turns do), but its blocks are usually evicted before it returns, and with them the
cache forgets that it ever saw them. This policy remembers, per *block identity* (the
content of the prefix up to and including the block), how many separate visits the block has
had, in a bounded *ghost* table that outlives eviction (ARC's ghost lists, at block level).
An entry's key is its last access time plus ``bonus * log2(visits)``: a block requested ``v``
times survives as if it had been used ``bonus * log2(v)`` clock units later. Never-revisited
blocks (one visit) sort exactly as under LRU; ties go to the deeper entry, as LRU's do.

The bonus adapts to the workload. With ``G`` the mean gap between two visits of the same block
seen so far and ``A`` the mean age (time since last access) of evicted entries, the bonus is
``G`` while ``A <= G``, falls linearly to 0 as ``A`` grows to ``2 G``, and is 0 beyond (plain
LRU). So "one doubling of the visits buys one typical revisit interval" on any time scale
(about 200 s on the trace, seconds on a fast synthetic workload), and a cache that already
keeps entries much longer than that (so LRU catches the returns) is left to LRU, where extra
protection would only crowd out fresh prefixes. Both means are running means, then
exponential averages (weight 1e-4 for gaps, 1e-3 for eviction ages). A fixed ``bonus``
replaces the rule.

Measured on the trace (``prefixkv bench trace``, see docs/benchmarks.md): 2.06x LRU's token
hit rate at 1M tokens of cache, 1.35x at 3M, 1.04x at 10M, equal to LRU from 20M up.

Signals and state (all kept through the hooks; the index needs no extra fields):

* Identity: a hashed block's ``hash`` (already chained over its prefix); for a radix node,
  each block's identity is ``hash((parent block identity, block tokens))`` folded from the
  root, memoized per node (a node's blocks only ever shrink to a sub-range, so a memo stays
  valid). Namespaces are not part of the identity: equal token paths share a count.
* Visits: a touch counts as a new visit of a block when at least ``min_gap`` clock units
  passed since the block's last counted visit, so a request's own match and inserts count
  once (the bench's clock gives them the same time; an engine's are milliseconds apart).
* The ghost table holds at most ``ghost_capacity`` identities (least recently counted dropped
  first): about 150 bytes each, so the default 65,536 costs about 10 MB. It must outlast the
  typical revisit interval: on the trace it needs >= 32,768 (about 5x a 3M-token cache).

Cost: a counted visit is O(blocks on the path) dict updates, a repeated touch within
``min_gap`` is O(nodes). A key is one memo and one table lookup; keys are declared monotone
(see the class attributes), so eviction frees a leaf's run of blocks in one step. At block size 1 every token is a block, so prefer block sizes >= 16
with this policy, or raise ``ghost_capacity`` well above the cached tokens.

A policy instance keeps per-index state: give each index its own instance.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from prefixkv.cache.block_identity import fold_identities, identity_root, is_hashed_block
from prefixkv.cache.policies import CacheEntry, EvictionPolicy

_ROOT_IDENTITY = identity_root("prefixkv.policy_ghost.root")
_GAP_AVERAGE_MIN_WEIGHT = 1e-4  # running mean for the first 10,000 revisit gaps, then EMA
_AGE_AVERAGE_MIN_WEIGHT = 1e-3  # running mean for the first 1,000 eviction ages, then EMA


class GhostPolicy(EvictionPolicy):
    """LRU with a ``bonus * log2(visits)`` lifetime bonus; visits are remembered past eviction.

    Args:
        bonus: clock units of extra lifetime per doubling of a block's visit count (> 0), or
            ``None`` (default) for the adaptive bonus of the module docstring.
        ghost_capacity: most block identities remembered (>= 1).
        min_gap: clock units between two touches for them to count as separate visits (>= 0).
    """

    name = "ghost"
    monotone_keys = True
    """A touch raises the last access time and the visits, so it never lowers a key (the
    adaptive bonus drifts between touches; a stale key is refreshed at the heap's top)."""
    depth_monotone_keys = True
    """The key reads the blocks through ``depth`` (the visits of the block there), and a
    block's visits include its descendants' (a visit of a block is a visit of its prefix), so
    the key grows toward the root: the index frees a leaf's run of blocks in one step."""

    def __init__(self, bonus: float | None = None, ghost_capacity: int = 65536,
                 min_gap: float = 1.0) -> None:
        if bonus is not None and (
            isinstance(bonus, bool) or not isinstance(bonus, (int, float)) or not bonus > 0
        ):
            raise ValueError(f"bonus must be a positive number or None, got {bonus!r}")
        if (isinstance(ghost_capacity, bool) or not isinstance(ghost_capacity, int)
                or ghost_capacity < 1):
            raise ValueError(f"ghost_capacity must be a positive int, got {ghost_capacity!r}")
        if isinstance(min_gap, bool) or not isinstance(min_gap, (int, float)) or min_gap < 0:
            raise ValueError(f"min_gap must be a non-negative number, got {min_gap!r}")
        self.bonus = None if bonus is None else float(bonus)
        self._gap_average = 0.0
        self._gaps_seen = 0
        self._age_average = 0.0
        self._ages_seen = 0
        self._now = float("-inf")  # the latest access time seen: the index clock's "now"
        self.ghost_capacity = ghost_capacity
        self.min_gap = float(min_gap)
        # identity -> [visits, time of the last counted visit]; oldest counted first
        self._visits: OrderedDict[Hashable, list[float]] = OrderedDict()
        # id(radix node) -> (node, start depth when memoized, identities of its blocks then),
        # dropped when the node leaves the index (only through eviction: ``on_evict``)
        self._memo: dict[int, tuple[Any, int, array[int]]] = {}

    # ------------------------------------------------------------------ policy
    def key(self, entry: CacheEntry) -> Any:
        depth = entry.depth
        memo = self._memo.get(id(entry))
        if memo is not None:  # a memoized node: :meth:`visits` inlined (the eviction path)
            idents, j = memo[2], depth - memo[1] - 1
            rec = self._visits.get(idents[j]) if 0 <= j < len(idents) else None
            visits = int(rec[0]) if rec is not None else 1
        else:
            visits = self.visits(entry)
        bonus = self.current_bonus * math.log2(visits) if visits > 1 else 0.0
        return (entry.last_access_time + bonus, -depth, entry.tick)

    def on_access(self, entry: CacheEntry) -> None:
        now = entry.last_access_time
        self._now = max(self._now, now)
        idents = self._identities(entry)
        if not idents:
            return
        table = self._visits
        tail = table.get(idents[-1])
        if tail is not None and now - tail[1] < self.min_gap:
            return  # this touch belongs to a visit already counted (a node's blocks move together)
        for ident in idents:
            rec = table.get(ident)
            if rec is None:
                table[ident] = [1, now]
            else:
                gap = now - rec[1]
                if gap >= self.min_gap:
                    rec[0] += 1
                    rec[1] = now
                    self._gaps_seen += 1
                    w = max(1.0 / self._gaps_seen, _GAP_AVERAGE_MIN_WEIGHT)
                    self._gap_average += w * (gap - self._gap_average)
                table.move_to_end(ident)
        while len(table) > self.ghost_capacity:
            table.popitem(last=False)

    def on_evict(self, entry: CacheEntry) -> None:
        self._memo.pop(id(entry), None)
        age = self._now - entry.last_access_time
        if age < 0:
            return
        self._ages_seen += 1
        w = max(1.0 / self._ages_seen, _AGE_AVERAGE_MIN_WEIGHT)
        self._age_average += w * (age - self._age_average)

    # ---------------------------------------------------------------- queries
    def visits(self, entry: CacheEntry) -> int:
        """Counted visits of ``entry``'s block at ``entry.depth`` (1 when unknown).

        Read through ``depth`` only, so a key probe at a smaller depth (the index's eviction
        of a run of blocks) sees the block that would be deepest then. A node is memoized
        when first keyed at its real depth (an evictable leaf is filed, so keyed, before any
        probe), and a memo stays valid as the node's blocks shrink to a sub-range."""
        e: Any = entry
        memo = None if is_hashed_block(e) else self._memo.get(id(e))
        if memo is not None:
            j = e.depth - memo[1] - 1
            ident = memo[2][j] if 0 <= j < len(memo[2]) else None
        else:
            idents = self._identities(e)
            ident = idents[-1] if idents else None
        rec = None if ident is None else self._visits.get(ident)
        return int(rec[0]) if rec is not None else 1

    @property
    def current_bonus(self) -> float:
        """The lifetime bonus per doubling of visits now (clock units)."""
        if self.bonus is not None:
            return self.bonus
        g, a = self._gap_average, self._age_average
        return g if a <= g else g * max(0.0, 2.0 - a / g)

    @property
    def ghost_size(self) -> int:
        """Block identities remembered now."""
        return len(self._visits)

    # ---------------------------------------------------------------- identity
    def _identities(self, entry: Any) -> Sequence[int]:
        """Identities of ``entry``'s blocks, shallowest first."""
        if is_hashed_block(entry):  # a hashed block: its chained hash is the identity
            return [entry.hash]
        return fold_identities(entry, _ROOT_IDENTITY, self._memoized, self._remember)

    def _remember(self, node: Any, identities: Sequence[int]) -> None:
        # an array: a node's memo dies with it (an eviction), freeing one buffer rather than
        # a Python int per block
        self._memo[id(node)] = (node, node.start_depth, array("q", identities))

    def _memoized(self, node: Any) -> Sequence[int] | None:
        rec = self._memo.get(id(node))
        if rec is None:
            return None
        _, start, idents = rec
        lo = node.start_depth - start
        hi = lo + node.num_blocks
        if lo < 0 or hi > len(idents) or hi <= lo:
            return None
        return idents if (lo == 0 and hi == len(idents)) else idents[lo:hi]
