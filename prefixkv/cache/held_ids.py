"""HeldIds: which block ids an index holds, which entry owns each, and the claim / release protocol.

Every id of ``[0, max_blocks)`` carries an *owner tag* (uint32, 0 = none), and every tag a count
of the entries holding ids stamped with it (one byte per tag); an id is held while its tag's
count is not zero. An insert *claims* the caller's new ids as its last check (so nothing can
fail after it) and stamps them with a fresh tag, the new entry's; a split entry's two parts share
their tag (:meth:`share`: O(1), the count goes up). Eviction *releases* ids either one by one (a
trimmed tail) or, when an entry leaves whole, through its tag (:meth:`release_owner`): O(1)
however many ids the entry held when it is the tag's only holder (a 1,024-token leaf at block
size 1 no longer costs a 1,024-id scatter), else its ids are cleared one by one. An id is held at
most once: claiming an id that is held, or the same id twice, is a ``ValueError`` that leaves
nothing marked.

A dead tag is reused only after a sweep (:meth:`_sweep`, O(ids covered) in numpy) has cleared
the ids still carrying it; sweeps run when no free tag is left and keep at least half the tag
space free (at least an eighth of the ids covered), so they cost O(1) amortized per claim. The
tags cover the ids up to the largest claimed so far (doubling as needed, up to ``max_blocks``):
an index over a huge id space that uses few ids (a router's tree) allocates little.

Block ids travel as :data:`BlockIds`, an ``array('I')`` (4 bytes an id, no Python int per id):
:meth:`HeldIds.pack` packs a caller's ids once, in C; a claim returns the claimed ids as a new
array that the entry keeps; matches and evictions concatenate those arrays (a memory copy, no
per-id Python work). Cost: a claim or explicit release of ``n`` ids is O(n), in C: a claim of
any size in one pass of the ``_keypack`` helper when it is built; releases, and claims without
the helper, in numpy over the arrays' buffers (indexing by ``intp``: numpy's uint32 fancy index
is 2-3x slower) from :data:`BULK` ids on, and a Python loop below that (faster there).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, TypeAlias, cast

import numpy as np

from prefixkv.cache._checks import check_block_ids
from prefixkv.cache._native import keypack as _keypack  # None: array() packs

BlockIds: TypeAlias = "array[int]"
"""Block ids as an ``array('I')``: a ``Sequence[int]`` that is compact and copied in C."""

ID_TYPECODE = "I"
"""The ``array`` typecode of :data:`BlockIds` (uint32)."""

MAX_BLOCKS = 2**32
"""Largest id space an index takes (ids are uint32)."""

BULK = 48
"""Releases, and claims without the C helper, of at least this many ids take the numpy path."""

_MIN_TAGS = 1024
"""Smallest tag space (it also grows to an eighth of the ids covered, so sweeps are rare)."""


def new_ids() -> BlockIds:
    """An empty :data:`BlockIds`."""
    return array(ID_TYPECODE)


class HeldIds:
    """The set of block ids held by one index (not thread safe: the index's lock guards it)."""

    __slots__ = ("_alive", "_aview", "_free", "_next", "_tags", "_tview", "count", "max_blocks")

    def __init__(self, max_blocks: int) -> None:
        if max_blocks > MAX_BLOCKS:
            raise ValueError(f"max_blocks must be <= 2**32 (uint32 block ids), got {max_blocks}")
        self.max_blocks = max_blocks
        start = min(max_blocks, _MIN_TAGS)
        self._tags = array("I", bytes(4 * start))  # the owner tag of each id covered, 0 = none
        self._tview = np.frombuffer(self._tags, dtype=np.uint32)  # shares the buffer (writable)
        self._alive = bytearray(0)
        self._aview: np.ndarray[Any, Any] = np.zeros(0, np.uint8)
        self._free = array("I")  # dead tags swept free (4 bytes each), popped from the end
        self._next = 1  # tags from here on were never used (tag 0 is "none", never alive)
        self._grow(_MIN_TAGS)
        self.count = 0

    def __contains__(self, block_id: object) -> bool:
        return (type(block_id) is int and 0 <= block_id < len(self._tags)
                and bool(self._alive[self._tags[block_id]]))

    def memory_bytes(self) -> int:
        """Bytes of the tags (four per id covered) and the holder counts (one per tag)."""
        return 4 * len(self._tags) + len(self._alive)

    def as_set(self) -> set[int]:
        """Every held id (O(ids covered); for invariant checks)."""
        return {int(b) for b in np.flatnonzero(self._aview[self._tview])}

    def owner_of(self, block_id: int) -> int:
        """The tag stamped on ``block_id`` (0 or a dead tag when it is not held)."""
        return int(self._tags[block_id]) if block_id < len(self._tags) else 0

    def pack(self, ids: Sequence[int], name: str = "kv_block_ids") -> BlockIds:
        """A caller's ids as :data:`BlockIds` (an ``array('I')`` is taken as is, not copied; a
        list or tuple of ints is read in one C pass when the helper is built: 1,024 ids 0.9 us,
        ``array('I', ids)`` 4 us).

        ``ValueError`` naming ``name`` for a non-int (a bool included: anywhere in a list or
        tuple, at either end of another sequence) or a value outside ``[0, 2**32)``; the range
        against ``max_blocks`` is checked by :meth:`claim`.
        """
        if type(ids) is array and ids.typecode == ID_TYPECODE:
            return ids
        listed = type(ids) is list or type(ids) is tuple
        if listed and _keypack is not None:
            words = _keypack.from_list(cast("list[Any]", ids), False, True)  # exact, [0, 2**32)
            if words is not None:
                packed = array(ID_TYPECODE)
                packed.frombytes(words)
                return packed
        if listed and any(type(b) is bool for b in ids):  # not a block id, wherever it is
            check_block_ids(list(ids), self.max_blocks, name)
        try:
            packed = array(ID_TYPECODE, ids)
        except (TypeError, OverflowError):
            check_block_ids(list(ids), self.max_blocks, name)  # raises the precise error
            raise ValueError(f"{name} must contain ints in [0, 2**32)") from None
        if packed and (type(ids[0]) is bool or type(ids[-1]) is bool):
            check_block_ids(list(ids), self.max_blocks, name)
        return packed

    # ----------------------------------------------------------------- releasing
    def release(self, ids: BlockIds) -> None:
        """Stop holding ``ids`` (they were held), one by one."""
        self._stamp(ids, 0)
        self.count -= len(ids)

    def release_owner(self, owner: int, ids: BlockIds) -> None:
        """Stop holding ``ids``, an entry's whole run (stamped ``owner``), as it leaves: O(1)
        when no other entry shares the tag."""
        left = self._alive[owner] - 1
        self._alive[owner] = left
        if left:
            self.release(ids)
        else:
            self.count -= len(ids)

    def share(self, owner: int, ids: BlockIds) -> int:
        """A new entry takes over ``ids``, part of ``owner``'s run (a split): returns its tag,
        ``owner`` itself (its count goes up) unless 255 entries already share it."""
        n = self._alive[owner]
        if n < 255:
            self._alive[owner] = n + 1
            return owner
        new = self._new_tag()
        self._stamp(ids, new)
        return new

    def holders(self, owner: int) -> int:
        """How many entries share ``owner`` (0: dead)."""
        return self._alive[owner]

    def _stamp(self, ids: BlockIds, tag: int) -> None:
        """Write ``tag`` on each of ``ids`` (covered ids)."""
        if len(ids) >= BULK:  # intp indices: numpy scatters uint32 ones 2-3x slower
            self._tview[np.frombuffer(ids, dtype=np.uint32).astype(np.intp)] = tag
        else:
            tags = self._tags
            for b in ids:
                tags[b] = tag

    # ------------------------------------------------------------------- claiming
    def claim(self, ids: BlockIds, cached: BlockIds, stop: int) -> tuple[list[int], BlockIds, int]:
        """Validate the caller's ids and hold ``ids[len(cached):stop]``; return the others.

        ``cached`` are the ids already held for the first positions: a caller id equal to its
        cached id is simply re-confirmed (no check, so re-inserting a long cached prefix costs
        one memory comparison); one that differs, and every id from ``stop`` on, is *returned*
        (it stays the caller's). ``ValueError``, with nothing marked, if an id is out of range,
        repeated, or already held.

        Returns the returned ids (a list), the claimed ones (a new array, the entry's own) and
        their owner tag (0 when nothing was claimed), which the entry keeps.
        """
        m = len(cached)
        returned: list[int] = []
        if ids[:m] != cached:
            returned = [mine for mine, theirs in zip(ids[:m], cached) if mine != theirs]
        returned += ids[stop:].tolist()
        taken = ids[m:stop]
        if returned:  # rare (duplicate blocks, hash collisions): the thorough check
            check_block_ids(returned + taken.tolist(), self.max_blocks)
            self._reserve(max(returned) + 1)
            tags, alive = self._tags, self._alive
            dup = next((b for b in returned if alive[tags[b]]), None)
            if dup is not None:
                raise ValueError(f"kv_block_ids: block id {dup} is already cached at another position")
        if not taken:
            return returned, taken, 0
        if _keypack is not None or len(taken) >= BULK:  # the helper: faster from one id on
            owner = self._claim_bulk(taken)
        else:
            owner = self._claim_short(taken)
        self.count += len(taken)
        return returned, taken, owner

    def _claim_short(self, taken: BlockIds) -> int:
        """Check and stamp a few ids in a Python loop (``ValueError``: nothing marked)."""
        hi = max(taken)
        if hi >= self.max_blocks:
            raise ValueError(f"kv_block_ids: block id {hi} out of range [0, {self.max_blocks})")
        self._reserve(hi + 1)
        owner = self._new_tag()
        tags, alive = self._tags, self._alive  # after the tag: a sweep may grow the counts
        i = 0
        try:
            for i, b in enumerate(taken):  # i is read on failure
                if alive[tags[b]]:
                    raise ValueError(f"kv_block_ids: block id {b} is repeated or already cached")
                tags[b] = owner
        except ValueError:
            for b in taken[:i]:
                tags[b] = 0
            alive[owner] = 0
            raise
        return owner

    def _claim_bulk(self, taken: BlockIds) -> int:
        """Check and stamp ``taken`` in C (``ValueError``: nothing marked): one pass of the
        helper when it is built (any count: 0.4-0.7 us for 1 to 512 ids, where the Python loop
        takes 0.9-2.8 us for 1 to 32), else numpy (about 3 us, from :data:`BULK` ids on)."""
        if _keypack is not None:
            hi = _keypack.max_u32(taken)
            if hi >= self.max_blocks:
                raise ValueError(f"kv_block_ids: block id {hi} out of range [0, {self.max_blocks})")
            self._reserve(hi + 1)
            owner = self._new_tag()  # before the buffers: a sweep may replace them
            bad = _keypack.claim_free(self._tags, self._alive, taken, owner)
            if bad >= 0:
                self._alive[owner] = 0
                raise ValueError(f"kv_block_ids: block id {taken[bad]} is repeated or already "
                                 "cached")
            return owner
        idx: np.ndarray[Any, Any] = np.frombuffer(taken, dtype=np.uint32)
        if not _is_run(idx):
            srt = np.sort(idx)
            idx = idx.astype(np.intp)  # gathers and scatters by intp are 2-3x faster
            hi = int(srt[-1])
            if hi >= self.max_blocks:
                raise ValueError(f"kv_block_ids: block id {hi} out of range [0, {self.max_blocks})")
            self._reserve(hi + 1)
            tv, av = self._tview, self._aview
            if not np.diff(srt).all() or np.count_nonzero(av.take(tv[idx], mode="clip")):
                bad = next((b for b in taken if av[tv[b]]), None)
                if bad is None:
                    bad = int(srt[1:][srt[1:] == srt[:-1]][0])
                raise ValueError(f"kv_block_ids: block id {bad} is repeated or already cached")
            owner = self._new_tag()
            tv[idx] = owner
            return owner
        lo, hi = min(taken[0], taken[-1]), max(taken[0], taken[-1])
        if hi >= self.max_blocks:
            raise ValueError(f"kv_block_ids: block id {hi} out of range [0, {self.max_blocks})")
        self._reserve(hi + 1)
        tv, av = self._tview, self._aview
        held = av.take(tv[lo : hi + 1], mode="clip")  # tags are < len(av): no bounds checks
        if np.count_nonzero(held):
            raise ValueError(f"kv_block_ids: block id {lo + int(held.argmax())} is repeated or "
                             "already cached")
        owner = self._new_tag()
        tv[lo : hi + 1] = owner
        return owner

    # ----------------------------------------------------------------------- tags
    def _new_tag(self) -> int:
        """A tag no id carries, marked alive (one holder)."""
        if self._free:
            owner = self._free.pop()
        elif self._next < len(self._alive):
            owner = self._next
            self._next += 1
        else:
            self._sweep()
            return self._new_tag()
        self._alive[owner] = 1
        return owner

    def _sweep(self) -> None:
        """Clear the ids stamped with dead tags, kill the tags no id carries (hashed claims, whose
        ids are released one by one), and list the dead tags as free; grow the tag space when
        less than half of it comes back free. O(ids covered + tags), in numpy."""
        tv, av = self._tview, self._aview
        tv[av[tv] == 0] = 0
        carried = np.zeros(len(av), dtype=bool)
        carried[tv] = True
        av[~carried] = 0
        free = array("I")  # largest first: popped from the end
        free.frombytes((np.flatnonzero(av[1:] == 0)[::-1] + 1).astype(np.uint32).tobytes())
        self._free = free
        if len(free) < len(av) // 2:
            self._grow(2 * len(av))

    def _reserve(self, n: int) -> None:
        """Make the tags cover the ids ``[0, n)`` (``n <= max_blocks``; doubling), and keep a
        tag for every eight ids covered."""
        size = len(self._tags)
        if n <= size:
            return
        new = min(self.max_blocks, max(n, 2 * size))
        self._tview = _NO_VIEW  # the array cannot grow while a numpy view exports its buffer
        try:
            self._tags.frombytes(bytes(4 * (new - size)))
        except BufferError:  # a view still lives elsewhere (a kept traceback's frame): copy
            grown = array("I", self._tags)
            grown.frombytes(bytes(4 * (new - size)))
            self._tags = grown
        self._tview = np.frombuffer(self._tags, dtype=np.uint32)
        if len(self._alive) < new // 8:
            self._grow(new // 8)

    def _grow(self, size: int) -> None:
        """Enlarge the tag space to ``size`` tags (the new ones are handed out from ``_next``)."""
        alive = bytearray(size)
        alive[: len(self._alive)] = self._alive
        self._alive = alive
        self._aview = np.frombuffer(alive, dtype=np.uint8)


_NO_VIEW: np.ndarray[Any, Any] = np.zeros(0, dtype=np.uint32)

_UP = np.array([1], dtype=np.uint32).tobytes()
_DOWN = np.array([0xFFFFFFFF], dtype=np.uint32).tobytes()  # -1 in uint32 arithmetic


def _is_run(idx: np.ndarray[Any, Any]) -> bool:
    """Whether ``idx`` (uint32) is a run of consecutive ids, ascending or descending (as a pool
    hands them out): then a slice of the tags checks and stamps it. One wrapping uint32
    subtraction, compared as bytes (a quarter of the time of an int64 ``diff``)."""
    first, last, n = int(idx[0]), int(idx[-1]), len(idx)
    if abs(last - first) != n - 1:
        return False
    return bool((idx[1:] - idx[:-1]).tobytes() == (_UP if last > first else _DOWN) * (n - 1))
