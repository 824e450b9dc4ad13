"""RadixNode, one edge of the radix tree, and the token-key comparisons the tree walks with.

A node's ``key`` is an ``array('H')`` (2 bytes a token) while every cached token id is below
2**16. Above that the tree widens every key once: to 18-bit *packed* keys (``bytes``, four ids in
nine bytes, 2.25 bytes a token; code ``"P"``) when the block size is a multiple of 4, every id
is below 2**18 (a 150k or 128k vocabulary) and the optional C helper
``prefixkv.cache._keypack`` is built (:data:`PACKED`), else to ``array('I')`` (4 bytes; and
from packed to ``array('I')`` when an id >= 2**18 arrives). A query is packed once into the
key's form, so comparing a whole key is one C-speed comparison (a query holding a larger id is
``array('I')`` and compares item by item, correctly, against narrow keys). Binary searches over
slices (:func:`common_blocks`) find where a query leaves a node in about one pass over the
common part. :func:`key_tokens` reads any key back as token ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from types import MappingProxyType
from typing import TypeAlias, cast

from prefixkv.cache._checks import check_tokens
from prefixkv.cache._native import keypack as _keypack  # None: the Python path
from prefixkv.cache.forest import EntryState
from prefixkv.cache.held_ids import BlockIds

PACKED = _keypack is not None
"""Whether 18-bit packed keys are available (the C helper was built)."""

Key: TypeAlias = "array[int] | bytes"
"""A node's tokens: ``array('H')``, ``array('I')`` or packed ``bytes`` (see the module doc)."""


class RadixNode(EntryState):
    """One edge of the tree: ``key`` tokens stored in ``blocks`` (``len(key) == len(blocks) * bs``).

    ``key`` is an ``array('H')``, ``array('I')`` or packed ``bytes`` (see the module doc; read
    it as tokens with :func:`key_tokens`) and ``blocks`` an
    ``array('I')`` of ids (:data:`~prefixkv.cache.held_ids.BlockIds`: matches and evictions
    copy runs of it in C, and no Python int is kept per id), all stamped with the node's
    ``owner`` tag (shared with the other parts when the node was split; 0 for a root, which
    holds none).

    ``children`` maps a child's first token to that child, or, when several children start
    with it (block size above 1 only: they differ later in their first block), to a tuple of
    them (:func:`kids` reads either). A node without children shares one read-only empty
    mapping (:data:`NO_CHILDREN`), replaced by a dict of its own when its first child is added.
    """

    __slots__ = ("blocks", "children", "key", "owner", "parent", "start_depth")

    def __init__(self, key: Key, blocks: BlockIds, parent: RadixNode | None, now: float,
                 start_depth: int = 0, owner: int = 0) -> None:
        super().__init__(now)
        self.key = key
        self.blocks = blocks
        self.owner = owner
        self.parent = parent
        self.children: dict[int, Child] = NO_CHILDREN
        self.start_depth = start_depth

    @property
    def is_root(self) -> bool:
        """Whether this is a namespace's root sentinel (the only node without a parent)."""
        return self.parent is None

    @property
    def num_blocks(self) -> int:
        """Blocks held by this node."""
        return len(self.blocks)

    @property
    def depth(self) -> int:
        """Blocks from the root through this node's last block."""
        return self.start_depth + len(self.blocks)

    def __repr__(self) -> str:
        return f"RadixNode(depth={self.depth}, blocks={len(self.blocks)}, lock={self.lock_ref})"


Child: TypeAlias = "RadixNode | tuple[RadixNode, ...]"
"""A value of :attr:`RadixNode.children`: the one child starting with a token, or several."""

NO_CHILDREN: dict[int, Child] = cast("dict[int, Child]", MappingProxyType({}))
"""The children of every childless node: read-only, so an add that forgot to give the node a
dict of its own fails loudly instead of sharing one (saves 64 bytes a leaf)."""


def kids(value: Child) -> tuple[RadixNode, ...]:
    """A :data:`Child` value as a tuple of nodes."""
    return (value,) if type(value) is RadixNode else value  # type: ignore[return-value]


def seg(tokens: Sequence[int], start: int, stop: int) -> array[int]:
    """``tokens[start:stop]`` as an array (a slice if ``tokens`` already is one, else packed
    into ``array('I')``).

    Converting also validates: a non-int raises ``ValueError``, and so does a negative or
    too large (>= 2**32) token id.
    """
    if type(tokens) is array:
        return tokens[start:stop]
    seg = tokens[start:stop]
    try:
        return array("I", seg)
    except (TypeError, OverflowError):
        check_tokens(seg)  # raises the precise ValueError
        raise


def lcp(key: array[int], start: int, tokens: Sequence[int], i: int, limit: int) -> int:
    """Length of the common prefix of ``key[start:]`` and ``tokens[i:]``, at most ``limit``."""
    p = 0
    stop = min(limit, len(key) - start)
    while p < stop and key[start + p] == tokens[i + p]:
        p += 1
    return p


def common_blocks(key: array[int], tokens: Sequence[int], i: int, n: int, bs: int) -> int:
    """Largest k with ``tokens[i:i+k*bs] == key[:k*bs]``.

    Binary search in which each probe compares only the not-yet-verified segment
    ``[lo, mid)``, so the total work is about one pass over the common prefix (at C speed).
    """
    lo, hi = 0, min(len(key), n - i) // bs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if seg(tokens, i + lo * bs, i + mid * bs) == key[lo * bs : mid * bs]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pack(tokens: array[int], start: int, stop: int) -> bytes:
    """``tokens[start:stop]`` (``array('H')`` or ``array('I')``) packed 18 bits a token, in whole
    groups of four, stopping before the first group holding an id >= 2**18 (so the result may
    be shorter: ``len(result) // 9 * 4`` tokens). Only when :data:`PACKED`."""
    assert _keypack is not None
    return _keypack.pack18(tokens, start, stop)


def packed_len(key: bytes) -> int:
    """Tokens in a packed key."""
    return len(key) // 9 * 4


def key_tokens(key: Key, start: int = 0, stop: int | None = None) -> array[int]:
    """Token ids ``start:stop`` of a key in any form, as an array (a slice for array keys)."""
    if not isinstance(key, bytes):
        return key[start:stop]
    assert _keypack is not None
    out = array("I")
    out.frombytes(_keypack.unpack18(key, start, packed_len(key) if stop is None else stop))
    return out


def first_token(key: Key) -> int:
    """A key's first token id (a node's place in its parent's ``children``)."""
    if isinstance(key, bytes):
        return key[0] | key[1] << 8 | (key[2] & 3) << 16
    return key[0]


def common_packed_blocks(raw: bytes, off: int, key: bytes, block_bytes: int) -> int:
    """Whole blocks of packed ``key`` equal to ``raw[off:]`` (a packed query)."""
    assert _keypack is not None
    return _keypack.common_bytes(raw, off, key, 0, len(key)) // block_bytes
