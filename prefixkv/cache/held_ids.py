"""HeldIds: which block ids an index holds, and the claim / release protocol for them.

One byte per id of ``[0, max_blocks)``. An insert *claims* the caller's new ids as its last
check (so nothing can fail after it), eviction *releases* them. An id is held at most once:
claiming an id that is held, or the same id twice, is a ``ValueError`` that leaves nothing
marked.

Cost: a claim or release of ``n`` ids is O(n), in C for long runs: a claim of at least
:data:`BULK` ids packs them once into an ``array('I')`` (``'q'`` for id spaces past 2**32;
returned to the caller, who keeps it
as the entry's compact copy of its ids) and checks and marks them with numpy over that buffer;
a release given such a copy clears the flags the same way. A claim whose ids are consecutive
(ascending or descending, as a block pool hands them out) is kept as a ``range`` instead: O(1)
memory, and a slice assignment to claim or release. Short runs use a Python loop, which is
faster below a few dozen ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np

from prefixkv.cache._checks import check_block_ids

Packed: TypeAlias = "array[int] | range"
"""A compact copy of an entry's ids: a ``range`` for a run of consecutive ids, else an array."""

BULK = 48
"""Claims of at least this many ids take the numpy path (and return a compact copy)."""


class HeldIds:
    """The set of block ids held by one index (not thread safe: the index's lock guards it)."""

    __slots__ = ("_code", "_flags", "_view", "count", "max_blocks")

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._flags = bytearray(max_blocks)
        self._view = np.frombuffer(self._flags, dtype=np.uint8)  # shares the bytes (writable)
        self.count = 0
        self._code = "I" if max_blocks <= 2**32 else "q"  # packed ids: 4 bytes each

    def __contains__(self, block_id: object) -> bool:
        return (type(block_id) is int and 0 <= block_id < self.max_blocks
                and bool(self._flags[block_id]))

    def memory_bytes(self) -> int:
        """Bytes of the flags (one per id of the space)."""
        return self.max_blocks

    def as_set(self) -> set[int]:
        """Every held id (O(max_blocks); for invariant checks)."""
        return {int(b) for b in np.flatnonzero(self._view)}

    def release(self, ids: Sequence[int], packed: Packed | None = None) -> None:
        """Stop holding ``ids`` (they were held). ``packed``, if given, holds the same ids (the
        compact copy a bulk claim returned, or a slice of it)."""
        if type(packed) is range:  # a run of consecutive ids: one slice assignment
            lo = min(packed[0], packed[-1])
            self._flags[lo : lo + len(packed)] = bytes(len(packed))
        elif packed is not None and len(packed) >= BULK:
            self._view[np.frombuffer(packed, dtype=packed.typecode)] = 0
        else:
            flags = self._flags
            for b in ids:
                flags[b] = 0
        self.count -= len(ids)

    def claim(self, ids: list[int], cached: list[int],
              stop: int) -> tuple[list[int], Packed | None]:
        """Validate the caller's ids and hold ``ids[len(cached):stop]``; return the others.

        ``cached`` are the ids already held for the first positions: a caller id equal to its
        cached id is simply re-confirmed (no check, so re-inserting a long cached prefix costs
        one list comparison); one that differs, and every id from ``stop`` on, is *returned*
        (it stays the caller's). ``ValueError``, with nothing marked, if an id is not an int,
        out of range, repeated, or already held.

        Returns the returned ids and, for a claim of at least :data:`BULK` ids, the claimed
        ids packed as an ``array('I')`` (else ``None``).
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
            return returned, None
        if len(taken) >= BULK:
            packed = self._claim_bulk(taken)
            self.count += len(taken)
            return returned, packed
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
        return returned, None

    def _claim_bulk(self, taken: list[int]) -> Packed:
        """Check and mark ``taken`` in C; returns them packed (``ValueError``: nothing marked)."""
        try:
            packed = array(self._code, taken)  # rejects non-ints (bools: caught below)
        except (TypeError, OverflowError):
            check_block_ids(taken, self.max_blocks)
            raise
        idx = np.frombuffer(packed, dtype=self._code)
        run = self._claim_run(taken, idx)
        if run is not None:
            return run
        srt = np.sort(idx)
        lo, hi = int(srt[0]), int(srt[-1])
        if lo < 0 or hi >= self.max_blocks:
            raise ValueError(f"kv_block_ids: block id {lo if lo < 0 else hi} out of range "
                             f"[0, {self.max_blocks})")
        view = self._view
        if not np.diff(srt).all() or view[idx].any():
            bad = next((b for b in taken if self._flags[b]), None)
            if bad is None:
                bad = int(srt[1:][srt[1:] == srt[:-1]][0])
            raise ValueError(f"kv_block_ids: block id {bad} is repeated or already cached")
        if type(taken[0]) is not int or type(taken[-1]) is not int:
            check_block_ids(taken, self.max_blocks)  # e.g. bools (the short path checks the
            # extremes the same way; every element is checked to be an index-able int)
        view[idx] = 1
        return packed

    def _claim_run(self, taken: list[int], idx: np.ndarray[Any, Any]) -> range | None:
        """Claim ``taken`` as a ``range`` if it is a run of consecutive ids (ascending or
        descending, as a pool hands them out); ``None`` (nothing marked) if it is not one."""
        first, last, n = taken[0], taken[-1], len(taken)
        if type(first) is not int or type(last) is not int or abs(last - first) != n - 1:
            return None
        if not (np.diff(idx if last > first else idx[::-1]) == 1).all():
            return None
        lo, hi = min(first, last), max(first, last)
        if lo < 0 or hi >= self.max_blocks:
            raise ValueError(f"kv_block_ids: block id {lo if lo < 0 else hi} out of range "
                             f"[0, {self.max_blocks})")
        flags = self._flags
        held = flags.find(1, lo, hi + 1)
        if held != -1:
            raise ValueError(f"kv_block_ids: block id {held} is repeated or already cached")
        flags[lo : hi + 1] = b"\x01" * n
        return range(first, last + (1 if last > first else -1), 1 if last > first else -1)
