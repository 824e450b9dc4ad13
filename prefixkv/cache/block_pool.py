"""BlockPool: the free list of KV block ids (pure Python; the engine owns the tensors).

Ownership: an id handed out by :meth:`BlockPool.allocate` belongs to the caller until it is
given back with :meth:`BlockPool.free` (directly, or after a prefix index took it and later
evicted it). Freed ids are reused oldest-freed first, so the ids of a finished request are
reused in the order they were freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from prefixkv.cache.protocol import PrefixCache


class BlockPool:
    """A fixed set of block ids ``[0, num_blocks)`` and the queue of free ones.

    Not thread safe by itself: the engine calls it from one thread (the index has its own lock).
    """

    __slots__ = ("_free", "_is_free", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = bytearray(b"\x01") * num_blocks

    @property
    def num_free(self) -> int:
        """Ids available without evicting anything."""
        return len(self._free)

    def allocate(self, n: int, *, evict_from: PrefixCache | None = None) -> list[int] | None:
        """Take ``n`` free ids; the caller owns them.

        If fewer than ``n`` are free and ``evict_from`` is given, evict the shortfall from that
        index first (its freed ids join the free queue). Returns ``None``, and changes nothing
        beyond those evictions, when ``n`` ids cannot be had.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        short = n - len(self._free)
        if short > 0 and evict_from is not None:
            if evict_from.num_evictable_blocks < short:
                return None
            self.free(evict_from.evict(short))
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._is_free[b] = 0
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Return ids to the pool; ``ValueError`` (and no change) on a bad or already-free id."""
        ids = list(block_ids)
        seen: set[int] = set()
        for b in ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b!r} out of range [0, {self.num_blocks})")
            if self._is_free[b] or b in seen:
                raise ValueError(f"block id {b} is already free (double free)")
            seen.add(b)
        for b in ids:
            self._is_free[b] = 1
        self._free.extend(ids)

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the free queue."""
        return bool(self._is_free[block_id])
