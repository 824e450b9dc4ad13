"""StreamedRead: remote records read piece by piece into the caller's buffers, pieces in order.

For a reader that can use the first part of every block before the rest has arrived: a vLLM
forward pass needs every loaded block's first layer before its second. Each record's payload is
cut at the same offsets ``cuts`` (``0 = c0 < c1 < ... < cn = nbytes``); piece ``g`` is its bytes
``[c_g, c_g+1)``. The blocks are split over the reader's connections (a contiguous run on
each); each connection asks, in one pipelined batch of ``GETRANGE``, for piece 0
of each of its blocks (with the record's header in front), then piece 1 of each, and so on, and
with a secret each record's MAC tag last; one piece's batch is sent while the one before it is
read. Piece ``g`` is *ready* once every connection has
delivered it for all of its blocks: :meth:`StreamedRead.wait` returns then. Each piece is
received straight into the buffers ``place(i, g)`` gives (vLLM's own KV memory): no copy.

Checks are :func:`~prefixkv.tiers.codec.decode`'s, made as the pieces pass
(:class:`~prefixkv.tiers.codec.RecordCheck`): the header with piece 0, the checksum and the MAC
once the last piece is in. So a block's bytes are in the caller's buffers before they are known
good: the caller must not let a block outlive the read before :meth:`StreamedRead.run` has
named it good (vLLM: a load error reported at the end of the step makes vLLM recompute the block
and drop what the step produced for its request). A piece of the wrong size (a missing key reads
as an empty string, a truncated record short) goes to a scratch buffer and fails its block.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from prefixkv.tiers.bulk_read import BulkReader, Range
from prefixkv.tiers.codec import TAG_BYTES, CorruptBlockError, RecordCheck, header_size

__all__ = ["MISSING", "OK", "UNREAD", "Place", "StreamedRead"]

Place = Callable[[int, int], Sequence[memoryview]]
"""``place(i, g)``: byte buffers (1-D, format ``B``) summing to piece ``g``'s size, where
block ``i``'s piece ``g`` is received."""
BATCH_BYTES = 4 << 20
"""Bytes asked for in one pipelined batch (at least one piece of one block): the server sends
nothing of a batch before it has run all of it."""
OK = "ok"
"""A block read whole, its checks passed."""
MISSING = "missing"
"""A block the server does not hold."""
UNREAD = "unread"
"""A block not read: the read failed (or was abandoned) first."""


class StreamedRead:
    """One batch of records (``names``: the server's keys; ``keys``: the block keys their
    records hold) read in pieces at ``cuts`` over ``connections`` connections at once;
    ``ValueError`` for cuts that do not run from 0 to ``nbytes`` increasing."""

    def __init__(self, names: Sequence[bytes], keys: Sequence[bytes], layout: str, nbytes: int,
                 cuts: Sequence[int], place: Place, secret: bytes | None = None,
                 connections: int = 1) -> None:
        if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != nbytes \
                or any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"cuts must rise from 0 to nbytes={nbytes}, got {list(cuts)}")
        if len(names) != len(keys):
            raise ValueError("names and keys differ in length")
        self.names, self.keys, self.cuts, self.place = list(names), list(keys), list(cuts), place
        self.pieces = len(cuts) - 1
        self._head = header_size(layout)
        self._secret = secret
        self._checks = [RecordCheck(k, layout, nbytes, secret) for k in keys]
        self.state: list[str | CorruptBlockError | None] = [None] * len(keys)
        """Per block: ``None`` until read, :data:`OK`, :data:`MISSING`, :data:`UNREAD`, or
        the :class:`CorruptBlockError` its record failed with."""
        self._bufs: dict[tuple[int, int], Sequence[memoryview]] = {}
        self._heads: dict[int, bytearray] = {}
        n = max(1, min(connections, len(keys)))
        step = -(-len(keys) // n) if keys else 1
        self._parts: list[list[list[Range]]] = []  # per connection: per piece, its GETRANGEs
        self._plan: list[list[tuple[int, int]]] = []  # per part: (block, piece) of each reply
        for a in range(0, len(keys), step):
            blocks = range(a, min(a + step, len(keys)))
            pieces = range(self.pieces + (secret is not None))
            self._plan.append([(i, g) for g in pieces for i in blocks])
            batches: list[list[Range]] = []
            for g in pieces:  # a batch: one piece of at most BATCH_BYTES worth of blocks
                start, end = self._span(g)
                per = max(1, BATCH_BYTES // (end - start))
                batches += [[(self.names[i], start, end) for i in blocks[b:b + per]]
                            for b in range(0, len(blocks), per)]
            self._parts.append(batches)
        self._ready = [0] * (self.pieces + 1)  # per piece: parts that delivered it
        self._over = not keys
        self._cond = threading.Condition()

    # ------------------------------------------------------------------ the consumer's side
    def wait(self, piece: int, timeout: float | None = None) -> bool:
        """Block until piece ``piece`` of every block is in its buffers (or the read ended,
        good or not); ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._over or self._ready[piece] >= len(self._parts), timeout)

    def abandon(self) -> None:
        """End the read: every block not read yet is :data:`UNREAD`; waiters are released."""
        with self._cond:
            for i, st in enumerate(self.state):
                if st is None:
                    self.state[i] = UNREAD
            self._over = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ the reading side
    def run(self, reader: BulkReader) -> None:
        """Read every block (blocking). On a failure the blocks not yet read are
        :data:`UNREAD`, waiters are released, and it is raised."""
        try:
            reader.getranges(self._parts, self._into, self._done)
        finally:
            self.abandon()  # releases the waiters (after a success every block has its state)

    def _span(self, g: int) -> tuple[int, int]:
        """Record bytes of piece ``g`` (``pieces``: the MAC tag)."""
        h = self._head
        if g == self.pieces:
            return h + self.cuts[-1], h + self.cuts[-1] + TAG_BYTES
        return (0 if g == 0 else h + self.cuts[g]), h + self.cuts[g + 1]

    def _into(self, part: int, j: int, size: int) -> Sequence[memoryview]:
        i, g = self._plan[part][j]
        start, end = self._span(g)
        if self.state[i] is not None or size != end - start:
            if self.state[i] is None:
                self.state[i] = MISSING if g == 0 and size == 0 else CorruptBlockError(
                    f"piece {g} is {size} bytes, expected {end - start} (truncated record)")
            bufs: Sequence[memoryview] = [memoryview(bytearray(size))]
        elif g == self.pieces:
            bufs = [memoryview(bytearray(TAG_BYTES))]
        else:
            bufs = list(self.place(i, g))
            if g == 0:
                self._heads[i] = head = bytearray(self._head)
                bufs = [memoryview(head), *bufs]
        self._bufs[part, j] = bufs
        return bufs

    def _done(self, part: int, j: int) -> None:
        i, g = self._plan[part][j]
        bufs = self._bufs.pop((part, j))
        if self.state[i] is None:
            check = self._checks[i]
            try:
                if g == 0:
                    check.head(self._heads.pop(i))
                    bufs = bufs[1:]
                if g < self.pieces:
                    for b in bufs:
                        check.update(b)
                if g == self.pieces - (self._secret is None):  # the block's last piece
                    check.finish(bufs[0] if g == self.pieces else b"")
                    self.state[i] = OK
            except CorruptBlockError as exc:
                self.state[i] = exc
        plan = self._plan[part]
        if j + 1 == len(plan) or plan[j + 1][1] != g:  # this part delivered piece g
            with self._cond:
                self._ready[g] += 1
                if self._ready[g] >= len(self._parts):
                    self._cond.notify_all()
