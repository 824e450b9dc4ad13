"""ExpertsPolicy: online choice among prefix-aware eviction experts, by shadow-cache hits.

Why (issue 12): each fixed policy fixes one way LRU fails and breaks another (ghost wins on
chat conversations and loses on agentic sessions; LRU-2 wins on agentic sessions and small
caches, and loses to ghost on conversations). As in ARC, LeCaR and Cacheus, this policy does
not guess: it runs every expert in a small *shadow cache* that holds metadata only (identities
and keys, no KV) and lets the real cache use the expert whose shadow hit most recently.

Experts. Each is a *key offset* in clock units added to the last access time, so every key
reads as a "virtual last use" and an entry keyed under one expert still compares sensibly
with entries keyed under another after a switch. ``G`` is the mean gap between two visits of
a block (measured online), ``v`` the block's visits, remembered after eviction in a bounded
ghost table (as :mod:`prefixkv.cache.policy_ghost`):

* ``lru``: 0 (plain LRU: the starting choice, kept while no expert does better);
* ``tail``: ``-G`` for a *dead tail* (a block seen once that never had a deeper block in the
  same touch: a request's last, partial block, rarely reused), else 0;
* ``ghost``: ``G * log2(v)`` (seen-before bonus: conversations that came back come back
  again), plus the ``tail`` rule;
* ``lru2``: ``-(last gap)``, i.e. the key is the previous visit (LRU-2); ``-G`` for one visit;
* ``s2``: ``-G`` for a block seen once, else 0 (second-touch admission, as S3-FIFO's small
  queue);
* ``rate``: ``-(mean gap between the block's visits)`` (LRU-K's rate); ``-G`` for one visit;
* ``hit``: ``-G`` unless the block was cached when last visited (ARC's T1 / T2 split).
* ``lru3``: the visit before the previous (LRU-K with K = 3), a missing visit counting ``G``
  before the oldest one seen: ``-(t - t_-2)``, ``-(last gap) - G`` for two visits, ``-2G``
  for one. It tells a session with a steady cadence from one with a single short gap.

Shadows. A block is *sampled* when its identity hash is ``0 mod sample_every``; each expert
keeps the sampled blocks of a simulated cache of ``resident / sample_every`` blocks (SHARDS-
style spatial sampling), where ``resident`` is the most blocks the real index has held (no
limit before its first eviction). On each counted visit of a sampled block every shadow
scores a hit if it holds it, then re-keys it and evicts down to its size (``hit`` asks its
own shadow whether the block was cached). Scores are exponential averages over ``window``
shadow sizes of sampled visits; every 16 sampled visits the real cache switches to the best
expert if its score beats the current one's by ``margin`` (relative), so a workload where
no expert helps stays on LRU. Keys already in the index's heap are refreshed when touched or
when they reach the top (the heap re-asks a top entry's key), so a switch takes effect
gradually.

Identity, visits and the ghost table work as in :mod:`prefixkv.cache.policy_ghost` (a
hashed block's chained hash; a radix node's per-block hashes folded from the root, memoized).
The table holds ``max(ghost_capacity, 8 * resident)`` identities, about 200 bytes each.

Cost: while ``lru`` is chosen, :meth:`key` is LRU's key; otherwise one memo and one table
lookup. Keys read the blocks through ``depth`` only and are declared monotone (see the class
attributes), so the index frees a leaf's run of blocks in one step and does not re-file a
leaf on every touch, as it does for LRU. A counted visit is O(blocks on the path) dict
updates plus, for the ``1 / sample_every`` sampled blocks, one heap push per expert.

A policy instance keeps per-index state: give each index its own instance.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from prefixkv.cache.block_identity import fold_identities, identity_root, is_hashed_block
from prefixkv.cache.policies import CacheEntry, EvictionPolicy

EXPERTS = ("lru", "tail", "ghost", "lru2", "s2", "rate", "hit", "lru3")
_ROOT = identity_root("prefixkv.policy_experts.root")
_GAP_MIN_WEIGHT = 1e-4  # running mean of revisit gaps for the first 10,000, then EMA
# fields of a ghost-table record (_HIT: the block was cached when last visited; _TPP: the
# counted visit before the previous one)
_V, _T, _TP, _INTERIOR, _DEPTH, _T0, _HIT, _TPP = range(8)


class _Shadow:
    """A metadata-only cache of sampled identities run by one expert (min key evicted)."""

    __slots__ = ("heap", "seq", "where")

    def __init__(self) -> None:
        self.where: dict[Hashable, int] = {}  # identity -> seq of its live heap item
        self.heap: list[tuple[float, int, int, Hashable]] = []
        self.seq = 0

    def put(self, ident: Hashable, key: float, depth: int) -> None:
        self.seq += 1
        self.where[ident] = self.seq
        heapq.heappush(self.heap, (key, -depth, self.seq, ident))
        if len(self.heap) > 2 * len(self.where) + 64:
            self.heap = [it for it in self.heap if self.where.get(it[3]) == it[2]]
            heapq.heapify(self.heap)

    def shrink(self, size: int) -> None:
        where, heap = self.where, self.heap
        while len(where) > size and heap:
            _, _, seq, ident = heapq.heappop(heap)
            if where.get(ident) == seq:
                del where[ident]


class ExpertsPolicy(EvictionPolicy):
    """Keys entries by the expert whose shadow cache hits most (see the module docstring).

    Args:
        experts: expert names, a non-empty subset of :data:`EXPERTS`; the first is the
            starting choice (default: all, ``lru`` first).
        sample_every: one block identity in this many is simulated in the shadows (>= 1).
        window: score averaging window, in shadow sizes of sampled visits (> 0).
        margin: relative score advantage needed to switch experts (>= 0).
        ghost_capacity: least block identities remembered (>= 1).
        min_gap: clock units between two touches for them to count as separate visits (>= 0).
    """

    name: str = "experts"
    monotone_keys = True
    """A touch never lowers a key under a fixed expert: it raises the last access time, the
    visits and the previous visit time, and marks the block cached when last visited. (A
    switch of expert, or a change of ``G``, may lower keys; the heap then holds lower or
    higher stale keys either way, refreshed when they reach its top.)"""
    depth_monotone_keys = True
    """Every expert's key reads the blocks through ``depth`` (the record of the block there),
    and grows toward the root: a block's visits include its descendants' (a visit of a block
    is a visit of its prefix), so shallower blocks have at least the visits, the last and
    previous visit times and the interior mark of deeper ones. Exceptions are rare and only
    reorder eviction slightly: ``lru2``/``lru3``/``rate``/``hit`` count a missing visit as
    ``-G``, which may exceed a parent's offset after a long gap, and a ghost-table drop loses
    a record."""

    def __init__(self, experts: tuple[str, ...] = EXPERTS, *, sample_every: int = 8,
                 window: float = 8.0, margin: float = 0.02, ghost_capacity: int = 65536,
                 min_gap: float = 1.0) -> None:
        if (not isinstance(experts, (tuple, list)) or not experts
                or any(e not in EXPERTS for e in experts) or len(set(experts)) != len(experts)):
            raise ValueError(f"experts must be distinct names from {EXPERTS}, got {experts!r}")
        _check_int(sample_every, "sample_every")
        _check_int(ghost_capacity, "ghost_capacity")
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0:
            raise ValueError(f"window must be a positive number, got {window!r}")
        for value, label in ((margin, "margin"), (min_gap, "min_gap")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{label} must be a non-negative number, got {value!r}")
        self.experts = tuple(experts)
        self.sample_every = sample_every
        self.window = float(window)
        self.margin = float(margin)
        self.ghost_capacity = ghost_capacity
        self.min_gap = float(min_gap)
        self._chosen = 0  # index into self.experts
        self._lru_chosen = self.experts[0] == "lru"
        self._offset_of = _OFFSETS[self.experts[0]]
        self.gap = 0.0  # G: mean revisit gap (clock units)
        self._gaps_seen = 0
        # identity -> [visits, last counted visit, previous counted visit, interior, depth,
        #              first visit, cached when last visited, the visit before the previous]
        self._table: OrderedDict[Hashable, list[Any]] = OrderedDict()
        # (tick, identity, record) of the deepest block of the touch in progress
        self._pending: tuple[int, Hashable, list[Any] | None] = (-1, None, None)
        self._shadows = [_Shadow() for _ in self.experts]
        self.scores = [0.0] * len(self.experts)
        self._sampled_visits = 0
        # id(entry) -> [entry, start depth when memoized, its blocks' identities or None], for
        # every entry seen and not evicted (entries leave an index only through eviction)
        self._entries: dict[int, list[Any]] = {}
        self._since_count = 0
        self.resident_max = 0
        self.history: list[tuple[float, str]] = [(float("-inf"), self.experts[0])]
        """``(clock time, expert)`` at the start and at every switch."""

    # ------------------------------------------------------------------ policy
    @property
    def chosen(self) -> str:
        """The expert keying the real cache now."""
        return self.experts[self._chosen]

    def key(self, entry: CacheEntry) -> Any:
        t = entry.last_access_time
        if self._lru_chosen:
            return (t, -entry.depth, entry.tick)
        depth = entry.depth
        memo = self._entries.get(id(entry))
        if memo is not None and memo[2] is not None:  # a memoized node, inlined (see _record)
            idents = memo[2]
            j = depth - memo[1] - 1
            rec = self._table.get(idents[j]) if 0 <= j < len(idents) else self._record(entry)
        else:  # a hashed block, or a node not memoized yet
            rec = self._record(entry)
        if rec is None:
            return (t, -depth, entry.tick)
        return (t + self._offset_of(rec, t, self.gap), -depth, entry.tick)

    def on_access(self, entry: CacheEntry) -> None:
        now = entry.last_access_time
        e: Any = entry
        entries = self._entries
        if id(e) not in entries:
            entries[id(e)] = [e, 0, None]
        self._since_count += 1
        if self.resident_max and self._since_count >= max(64, len(entries)):
            self._count_resident()
        idents = self._identities(e)
        if not idents:
            return
        table = self._table
        tick, p_ident, pending = self._pending
        if pending is not None and tick == entry.tick and not pending[_INTERIOR]:
            self._mark_interior(p_ident, pending)  # a deeper block came in the same touch
        tail = table.get(idents[-1])
        if tail is not None and now - tail[_T] < self.min_gap:
            # This touch belongs to a visit already counted. The entry's other blocks are
            # interior already: any touch that reached its last block passed through them,
            # marking each (a node's inner block in its loop below, an ancestor's last block
            # through ``_pending``), and a record is only ever created by that loop.
            self._pending = (entry.tick, idents[-1], tail)
            return
        depth0 = entry.depth - len(idents)
        last = len(idents) - 1
        was_cached = entry.access_count > 1  # a new entry's first touch is its insert
        rec: list[Any] | None = None
        for j, ident in enumerate(idents):
            rec = table.get(ident)
            if rec is None:
                rec = [1, now, now, j < last, depth0 + j + 1, now, was_cached, now]
                table[ident] = rec
            else:
                gap = now - rec[_T]
                if gap < self.min_gap:
                    if j < last and not rec[_INTERIOR]:
                        self._mark_interior(ident, rec)
                    continue
                rec[_V] += 1
                rec[_HIT] = was_cached
                rec[_TPP] = rec[_TP]
                rec[_TP] = rec[_T]
                rec[_T] = now
                if j < last:
                    rec[_INTERIOR] = True
                self._gaps_seen += 1
                w = max(1.0 / self._gaps_seen, _GAP_MIN_WEIGHT)
                self.gap += w * (gap - self.gap)
                table.move_to_end(ident)
            if self._sampled(ident):
                self._visit_shadows(ident, rec, now)
        self._pending = (entry.tick, idents[-1], rec)
        cap = max(self.ghost_capacity, 8 * self.resident_max)
        while len(table) > cap:
            table.popitem(last=False)

    def on_evict(self, entry: CacheEntry) -> None:
        if self.resident_max == 0:  # the first eviction: the real cache is full now
            self._count_resident()
        self._entries.pop(id(entry), None)

    # ---------------------------------------------------------------- queries
    def expert_offset(self, expert: str, entry: CacheEntry) -> float:
        """Key offset (clock units) that ``expert`` gives ``entry`` now."""
        rec = self._record(entry)
        return 0.0 if rec is None else self._offset(expert, rec, entry.last_access_time)

    @property
    def shadow_size(self) -> int | None:
        """Blocks each shadow cache may hold now (sampled identities); ``None`` (no limit)
        until the real cache first evicts."""
        if not self.resident_max:
            return None
        return max(1, self.resident_max // self.sample_every)

    @property
    def ghost_size(self) -> int:
        """Block identities remembered now."""
        return len(self._table)

    # ---------------------------------------------------------------- internals
    def _offset(self, expert: str, rec: list[Any], t: float) -> float:
        return _OFFSETS[expert](rec, t, self.gap)

    def _record(self, entry: Any) -> list[Any] | None:
        """The ghost-table record of ``entry``'s block at ``entry.depth`` (``None`` if unknown).

        Read through ``depth`` only, so a key probe at a smaller depth (the index's eviction
        of a run of blocks) sees the record of the block that would be deepest then. An entry
        not memoized by a touch yet is folded here (never during a probe: every evictable
        leaf was touched when it was inserted, and a memo survives splits and trims)."""
        if is_hashed_block(entry):
            return self._table.get(entry.hash)
        memo = self._entries.get(id(entry))
        if memo is not None and memo[2] is not None:  # no list slicing: one index
            idents = memo[2]
            j = entry.depth - memo[1] - 1
            if 0 <= j < len(idents) and entry.num_blocks:
                return self._table.get(idents[j])
        idents = self._identities(entry)
        return self._table.get(idents[-1]) if idents else None

    def _mark_interior(self, ident: Hashable, rec: list[Any]) -> None:
        """A deeper block followed ``ident`` in one touch: not a dead tail; re-key shadows."""
        rec[_INTERIOR] = True
        if not self._sampled(ident):
            return
        for expert, shadow in zip(self.experts, self._shadows):
            if ident in shadow.where and expert in ("tail", "ghost"):
                shadow.put(ident, rec[_T] + self._offset(expert, rec, rec[_T]), rec[_DEPTH])

    def _sampled(self, ident: Hashable) -> bool:
        h = ident if isinstance(ident, int) else _int_hash(ident)
        return h % self.sample_every == 0

    def _visit_shadows(self, ident: Hashable, rec: list[Any], now: float) -> None:
        size = self.shadow_size
        decay = 1.0 - 1.0 / (self.window * (size or len(self._shadows[0].where) + 1))
        scores = self.scores
        for k, (expert, shadow) in enumerate(zip(self.experts, self._shadows)):
            hit = ident in shadow.where
            scores[k] = scores[k] * decay + (1.0 if hit else 0.0)
            if expert == "hit":  # cached in *this* shadow, not in the real cache
                off = 0.0 if hit else -self.gap
            else:
                off = self._offset(expert, rec, now)
            shadow.put(ident, now + off, rec[_DEPTH])
            if size is not None:
                shadow.shrink(size)
        self._sampled_visits += 1
        if self._sampled_visits % 16 == 0:
            self._choose(now)

    def _choose(self, now: float) -> None:
        scores = self.scores
        best = max(range(len(scores)), key=scores.__getitem__)
        if best != self._chosen and scores[best] > scores[self._chosen] * (1.0 + self.margin):
            self._chosen = best
            self._lru_chosen = self.experts[best] == "lru"
            self._offset_of = _OFFSETS[self.experts[best]]
            self.history.append((now, self.experts[best]))
            self.key_epoch += 1  # the index re-keys its evictable leaves under the new expert

    def _count_resident(self) -> None:
        self._since_count = 0
        resident = sum(r[0].num_blocks for r in self._entries.values())
        self.resident_max = max(self.resident_max, resident)

    def _identities(self, entry: Any) -> Sequence[Any]:
        """Identities of ``entry``'s blocks, shallowest first (see policy_ghost)."""
        if is_hashed_block(entry):
            return [entry.hash]
        return fold_identities(entry, _ROOT, self._memoized, self._remember)

    def _remember(self, node: Any, identities: Sequence[int]) -> None:
        # an array, not a list: dropping a memo (an eviction) frees one buffer instead of
        # decrementing a Python int per block (a cache miss each, on the eviction path)
        self._entries[id(node)] = [node, node.start_depth, array("q", identities)]

    def _memoized(self, node: Any) -> Sequence[int] | None:
        rec = self._entries.get(id(node))
        if rec is None or rec[2] is None:
            return None
        start: int = rec[1]
        idents: array[int] = rec[2]
        lo = node.start_depth - start
        hi = lo + node.num_blocks
        if lo < 0 or hi > len(idents) or hi <= lo:
            return None
        return idents if (lo == 0 and hi == len(idents)) else idents[lo:hi]


def _ghost(rec: list[Any], t: float, g: float) -> float:
    v = rec[_V]
    if v > 1:
        return g * math.log2(v)
    return 0.0 if rec[_INTERIOR] else -g  # a dead tail: seen once, never interior


_Offset = Callable[[list[Any], float, float], float]
_OFFSETS: dict[str, _Offset] = {  # expert -> offset(record, last access time, G)
    "lru": lambda rec, t, g: 0.0,
    "tail": lambda rec, t, g: -g if rec[_V] == 1 and not rec[_INTERIOR] else 0.0,  # dead
    "ghost": _ghost,
    # the previous visit's time (a single visit: G before the last)
    "lru2": lambda rec, t, g: rec[_TP] - t if rec[_V] > 1 else -g,
    # the visit before the previous (LRU-3); each missing visit G before the oldest seen
    "lru3": lambda rec, t, g: (rec[_TPP] - t if rec[_V] > 2 else
                               rec[_TP] - t - g if rec[_V] == 2 else -2 * g),
    "s2": lambda rec, t, g: -g if rec[_V] == 1 else 0.0,  # second-touch admission
    # the mean gap between the block's visits (LRU-K's rate)
    "rate": lambda rec, t, g: (rec[_T0] - t) / (rec[_V] - 1) if rec[_V] > 1 else -g,
    # cached when last visited (ARC's T2), else T1
    "hit": lambda rec, t, g: 0.0 if rec[_HIT] else -g,
}


def _int_hash(ident: Hashable) -> int:
    if isinstance(ident, (bytes, bytearray)):
        return int.from_bytes(bytes(ident[:8]), "little")
    return hash(ident)


def _check_int(value: object, label: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be a positive int, got {value!r}")
