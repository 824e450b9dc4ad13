"""HeldIds: which block ids an index holds, and the claim / release protocol for them.

One byte per id of ``[0, max_blocks)``. An insert *claims* the caller's new ids as its last
check (so nothing can fail after it), eviction *releases* them. An id is held at most once:
claiming an id that is held, or the same id twice, is a ``ValueError`` that leaves nothing
marked.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixkv.cache._checks import check_block_ids


class HeldIds:
    """The set of block ids held by one index (not thread safe: the index's lock guards it)."""

    __slots__ = ("_flags", "count", "max_blocks")

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._flags = bytearray(max_blocks)
        self.count = 0

    def __contains__(self, block_id: object) -> bool:
        return (type(block_id) is int and 0 <= block_id < self.max_blocks
                and bool(self._flags[block_id]))

    def as_set(self) -> set[int]:
        """Every held id (O(max_blocks); for invariant checks)."""
        return {b for b, f in enumerate(self._flags) if f}

    def release(self, ids: Sequence[int]) -> None:
        """Stop holding ``ids`` (they were held)."""
        flags = self._flags
        for b in ids:
            flags[b] = 0
        self.count -= len(ids)

    def claim(self, ids: list[int], cached: list[int], stop: int) -> list[int]:
        """Validate the caller's ids and hold ``ids[len(cached):stop]``; return the others.

        ``cached`` are the ids already held for the first positions: a caller id equal to its
        cached id is simply re-confirmed (no check, so re-inserting a long cached prefix costs
        one list comparison); one that differs, and every id from ``stop`` on, is *returned*
        (it stays the caller's). ``ValueError``, with nothing marked, if an id is not an int,
        out of range, repeated, or already held.
        """
        m = len(cached)
        returned: list[int] = []
        if ids[:m] != cached:
            returned = [mine for mine, theirs in zip(ids[:m], cached) if mine != theirs]
        returned += ids[stop:]
        taken = ids[m:stop]
        flags = self._flags
        if returned:  # rare (duplicate blocks, hash collisions): the thorough check
            check_block_ids(returned + taken, self.max_blocks)
            if any(map(flags.__getitem__, returned)):
                dup = next(b for b in returned if flags[b])
                raise ValueError(f"kv_block_ids: block id {dup} is already cached at another position")
        if not taken:
            return returned
        try:
            lo, hi = min(taken), max(taken)
        except TypeError:
            check_block_ids(taken, self.max_blocks)  # raises with the offending element
            raise
        if type(lo) is not int or type(hi) is not int:
            check_block_ids(taken, self.max_blocks)
        if lo < 0 or hi >= self.max_blocks:
            raise ValueError(f"kv_block_ids: block id {lo if lo < 0 else hi} out of range "
                             f"[0, {self.max_blocks})")
        i = 0
        try:
            for i, b in enumerate(taken):
                if flags[b]:
                    raise ValueError(f"kv_block_ids: block id {b} is repeated or already cached")
                flags[b] = 1
        except (ValueError, TypeError) as exc:
            for b in taken[:i]:
                flags[b] = 0
            if isinstance(exc, TypeError):
                check_block_ids(taken, self.max_blocks)
            raise
        self.count += len(taken)
        return returned
