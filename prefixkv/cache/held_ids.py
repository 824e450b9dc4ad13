"""HeldIds: which block ids an index holds, and the claim / release protocol for them.

One byte per id of ``[0, max_blocks)``. An insert *claims* the caller's new ids as its last
check (so nothing can fail after it), eviction *releases* them. An id is held at most once:
claiming an id that is held, or the same id twice, is a ``ValueError`` that leaves nothing
marked.

Block ids travel as :data:`BlockIds`, an ``array('I')`` (4 bytes an id, no Python int per id):
:meth:`HeldIds.pack` packs a caller's ids once, in C; a claim returns the claimed ids as a new
array that the entry keeps; matches and evictions concatenate those arrays (a memory copy, no
per-id Python work). Cost: a claim or release of ``n`` ids is O(n), in C (numpy over the array's
buffer, indexing by ``intp``: numpy's uint32 fancy index is 2-3x slower) from :data:`BULK` ids
on; short runs use a Python loop, faster below a few dozen ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np

from prefixkv.cache._checks import check_block_ids

BlockIds: TypeAlias = "array[int]"
"""Block ids as an ``array('I')``: a ``Sequence[int]`` that is compact and copied in C."""

ID_TYPECODE = "I"
"""The ``array`` typecode of :data:`BlockIds` (uint32)."""

MAX_BLOCKS = 2**32
"""Largest id space an index takes (ids are uint32; the flags alone would be 4 GiB)."""

BULK = 48
"""Claims and releases of at least this many ids take the numpy path."""


def new_ids() -> BlockIds:
    """An empty :data:`BlockIds`."""
    return array(ID_TYPECODE)


class HeldIds:
    """The set of block ids held by one index (not thread safe: the index's lock guards it)."""

    __slots__ = ("_flags", "_view", "count", "max_blocks")

    def __init__(self, max_blocks: int) -> None:
        if max_blocks > MAX_BLOCKS:
            raise ValueError(f"max_blocks must be <= 2**32 (uint32 block ids), got {max_blocks}")
        self.max_blocks = max_blocks
        self._flags = bytearray(max_blocks)
        self._view = np.frombuffer(self._flags, dtype=np.uint8)  # shares the bytes (writable)
        self.count = 0

    def __contains__(self, block_id: object) -> bool:
        return (type(block_id) is int and 0 <= block_id < self.max_blocks
                and bool(self._flags[block_id]))

    def memory_bytes(self) -> int:
        """Bytes of the flags (one per id of the space)."""
        return self.max_blocks

    def as_set(self) -> set[int]:
        """Every held id (O(max_blocks); for invariant checks)."""
        return {int(b) for b in np.flatnonzero(self._view)}

    def pack(self, ids: Sequence[int], name: str = "kv_block_ids") -> BlockIds:
        """A caller's ids as :data:`BlockIds` (an ``array('I')`` is taken as is, not copied).

        ``ValueError`` naming ``name`` for a non-int (a bool at either end included) or a value
        outside ``[0, 2**32)``; the range against ``max_blocks`` is checked by :meth:`claim`.
        """
        if type(ids) is array and ids.typecode == ID_TYPECODE:
            return ids
        try:
            packed = array(ID_TYPECODE, ids)
        except (TypeError, OverflowError):
            check_block_ids(list(ids), self.max_blocks, name)  # raises the precise error
            raise ValueError(f"{name} must contain ints in [0, 2**32)") from None
        if packed and (type(ids[0]) is bool or type(ids[-1]) is bool):
            check_block_ids(list(ids), self.max_blocks, name)
        return packed

    def release(self, ids: BlockIds) -> None:
        """Stop holding ``ids`` (they were held)."""
        if len(ids) >= BULK:  # intp indices: numpy scatters uint32 ones 2-3x slower
            self._view[np.frombuffer(ids, dtype=np.uint32).astype(np.intp)] = 0
        else:
            flags = self._flags
            for b in ids:
                flags[b] = 0
        self.count -= len(ids)

    def claim(self, ids: BlockIds, cached: BlockIds, stop: int) -> tuple[list[int], BlockIds]:
        """Validate the caller's ids and hold ``ids[len(cached):stop]``; return the others.

        ``cached`` are the ids already held for the first positions: a caller id equal to its
        cached id is simply re-confirmed (no check, so re-inserting a long cached prefix costs
        one memory comparison); one that differs, and every id from ``stop`` on, is *returned*
        (it stays the caller's). ``ValueError``, with nothing marked, if an id is out of range,
        repeated, or already held.

        Returns the returned ids (a list) and the claimed ones (a new array, the entry's own).
        """
        m = len(cached)
        returned: list[int] = []
        if ids[:m] != cached:
            returned = [mine for mine, theirs in zip(ids[:m], cached) if mine != theirs]
        returned += ids[stop:].tolist()
        taken = ids[m:stop]
        flags = self._flags
        if returned:  # rare (duplicate blocks, hash collisions): the thorough check
            check_block_ids(returned + taken.tolist(), self.max_blocks)
            if any(map(flags.__getitem__, returned)):
                dup = next(b for b in returned if flags[b])
                raise ValueError(f"kv_block_ids: block id {dup} is already cached at another position")
        if not taken:
            return returned, taken
        if len(taken) >= BULK:
            self._claim_bulk(taken)
            self.count += len(taken)
            return returned, taken
        hi = max(taken)
        if hi >= self.max_blocks:
            raise ValueError(f"kv_block_ids: block id {hi} out of range [0, {self.max_blocks})")
        i = 0
        try:
            for i, b in enumerate(taken):  # i is read on failure
                if flags[b]:
                    raise ValueError(f"kv_block_ids: block id {b} is repeated or already cached")
                flags[b] = 1
        except ValueError:
            for b in taken[:i]:
                flags[b] = 0
            raise
        self.count += len(taken)
        return returned, taken

    def _claim_bulk(self, taken: BlockIds) -> None:
        """Check and mark ``taken`` in C (``ValueError``: nothing marked)."""
        idx: np.ndarray[Any, Any] = np.frombuffer(taken, dtype=np.uint32)
        view = self._view
        if not _is_run(idx):
            srt = np.sort(idx)
            idx = idx.astype(np.intp)  # gathers and scatters by intp are 2-3x faster
            hi = int(srt[-1])
            if hi >= self.max_blocks:
                raise ValueError(f"kv_block_ids: block id {hi} out of range [0, {self.max_blocks})")
            if not np.diff(srt).all() or view[idx].any():
                bad = next((b for b in taken if self._flags[b]), None)
                if bad is None:
                    bad = int(srt[1:][srt[1:] == srt[:-1]][0])
                raise ValueError(f"kv_block_ids: block id {bad} is repeated or already cached")
            view[idx] = 1
            return
        lo, hi = min(taken[0], taken[-1]), max(taken[0], taken[-1])
        if hi >= self.max_blocks:
            raise ValueError(f"kv_block_ids: block id {hi} out of range [0, {self.max_blocks})")
        held = self._flags.find(1, lo, hi + 1)
        if held != -1:
            raise ValueError(f"kv_block_ids: block id {held} is repeated or already cached")
        self._flags[lo : hi + 1] = b"\x01" * len(taken)


def _is_run(idx: np.ndarray[Any, Any]) -> bool:
    """Whether ``idx`` is a run of consecutive ids, ascending or descending (as a pool hands
    them out): then a slice of the flags checks and marks it."""
    first, last, n = int(idx[0]), int(idx[-1]), len(idx)
    if abs(last - first) != n - 1:
        return False
    step = np.diff(idx.astype(np.int64))
    return bool((step == (1 if last > first else -1)).all())
