"""One worker's approximate prefix tree: what the router believes that worker has cached.

The router never sees a worker's real cache. Like SGLang's router (seed 003), it keeps, for each
worker, a radix tree of the prompts it sent there, and assumes the worker cached them until the
tree forgets them under its own LRU bound. The tree is a :class:`~prefixkv.cache.RadixPrefixCache`
(block size 1, one element per key chunk: see :mod:`prefixkv.router.keys`), not a second tree
implementation.

Values. The cache stores "block ids"; here they are fake ids that only measure size, one per key
chunk, handed out by :class:`LazyIds` (a counter and a free list), so memory grows with what is
stored rather than with the bound (no preallocated pool).

Bounds (SGLang's semantics): :meth:`ApproxTree.trim` cuts the tree down to ``max_size`` chunks,
least recently used leaves first; the caller decides when (every ``eviction_interval``). Between
trims a tree may grow up to ``2 * max_size``; an insert beyond that evicts LRU leaves at once.

Eviction order: LRU by default; ``eviction_policy`` takes any name of
:data:`prefixkv.cache.POLICIES` (``lru``, ``lfu``, ``fifo``, ``ghost``, ``experts``), built by
:func:`prefixkv.cache.make_policy`, so a tree can replay the eviction of a worker that runs
another policy (``cache_aware --simulate-eviction``). The cache has no read-only match: a
:meth:`ApproxTree.match` counts as a use (recency, frequency) even when the request then goes to
another worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prefixkv.cache import EvictionPolicy, RadixPrefixCache, make_policy
from prefixkv.router.keys import RouteKey

__all__ = ["ApproxTree", "LazyIds"]


class LazyIds:
    """Distinct ids in ``[0, limit)``: freed ones first, else the next never-used one.

    Ownership: an id returned by :meth:`take` is the caller's until given back with :meth:`give`.
    Memory is the high-water mark of ids in use, not ``limit``.
    """

    __slots__ = ("_free", "_next", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._next = 0
        self._free: list[int] = []

    @property
    def available(self) -> int:
        """Ids that can be taken now."""
        return len(self._free) + self.limit - self._next

    def take(self, n: int) -> list[int]:
        """``n`` ids (``ValueError`` if fewer are available)."""
        if n > self.available:
            raise ValueError(f"only {self.available} ids available, asked for {n}")
        k = min(n, len(self._free))
        out = self._free[len(self._free) - k :]
        del self._free[len(self._free) - k :]
        fresh = n - k
        out.extend(range(self._next, self._next + fresh))
        self._next += fresh
        return out

    def give(self, ids: Iterable[int]) -> None:
        """Return ids taken before."""
        self._free.extend(ids)

    def clear(self) -> None:
        """Every id is free again (the caller holds none)."""
        self._free = []
        self._next = 0


class ApproxTree:
    """One worker's approximate prefix tree over chunk keys.

    Owns its cache and its ids; ids never leave this object. Used from the router's event loop
    only (the cache's own lock makes each call atomic).
    """

    __slots__ = ("_cache", "_clock", "_ids", "max_size")

    def __init__(self, max_size: int, *, eviction_policy: str = "lru",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size <= 0:
            raise ValueError(f"max_size must be a positive int, got {max_size!r}")
        self.max_size = max_size
        self._clock = clock
        self._ids = LazyIds(2 * max_size)
        self._cache = self._new_cache(eviction_policy)

    def _new_cache(self, eviction_policy: str | EvictionPolicy) -> RadixPrefixCache:
        # one policy instance per tree: ghost and experts keep per-index state
        return RadixPrefixCache(self._ids.limit, block_size=1, clock=self._clock,
                                eviction_policy=make_policy(eviction_policy))

    @property
    def eviction_policy(self) -> str:
        """The name of the policy that orders this tree's evictions."""
        return self._cache.policy.name

    def set_eviction_policy(self, name: str) -> bool:
        """Order evictions by the policy ``name`` from now on (``ValueError`` naming
        ``eviction_policy`` if unknown). The cache takes its policy when built, so a change
        empties the tree; returns whether it changed."""
        policy = make_policy(name)  # validates before anything is dropped
        if policy.name == self.eviction_policy:
            return False
        self._cache = self._new_cache(policy)
        self._ids.clear()
        return True

    @property
    def size(self) -> int:
        """Chunks the tree holds now."""
        return self._cache.num_cached_blocks

    def match(self, key: RouteKey) -> int:
        """Leading chunks of ``key`` in the tree (refreshes their recency)."""
        if not key.chunks:
            return 0
        return self._cache.match_prefix(key.chunks, namespace=key.namespace).match_length

    def insert(self, key: RouteKey, *, trim: bool = False) -> None:
        """Record that the worker received ``key``; evicts leaves (policy order) if the tree is
        full. With ``trim``, then trims to ``max_size`` while ``key``'s own chunks stay: the
        request is running on the worker, whose blocks are locked there until it ends.

        A key longer than ``2 * max_size`` keeps only its leading part.
        """
        if not key.chunks:
            return
        m = self._cache.match_prefix(key.chunks, namespace=key.namespace, lock=True)
        node = None
        try:
            room = self._ids.available + self._cache.num_evictable_blocks
            n = min(len(key.chunks) - m.match_length, room)
            if n > 0:
                short = n - self._ids.available
                if short > 0:
                    self._ids.give(self._cache.evict(short))
                node = self._cache.insert_prefix(
                    key.chunks[: m.match_length + n], [*m.matched_kv_blocks, *self._ids.take(n)],
                    namespace=key.namespace, lock=trim,
                )
                self._ids.give(node.returned_block_ids)
            if trim:
                self.trim()
        finally:
            if node is not None and trim:
                self._cache.unlock(node)
            self._cache.unlock(m)

    def trim(self) -> int:
        """Evict leaves (policy order) down to ``max_size``, or as far as unlocked chunks allow;
        returns how many chunks left the tree."""
        excess = self._cache.num_cached_blocks - self.max_size
        if excess <= 0:
            return 0
        freed = self._cache.evict(excess)
        self._ids.give(freed)
        return len(freed)

    def reset(self) -> None:
        """Forget everything (the worker restarted or reset its cache)."""
        self._cache.reset()
        self._ids.clear()
