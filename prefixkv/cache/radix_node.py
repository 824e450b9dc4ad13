"""RadixNode, one edge of the radix tree, and the token-key comparisons the tree walks with.

A node's ``key`` is an ``array('H')`` (2 bytes a token) while every cached token id is below
2**16, else an ``array('I')`` (4 bytes; the tree widens every key once when the first larger id
is inserted); a query is packed once into the same type, so comparing a whole key is one
C-speed slice comparison (a query holding a larger id is ``array('I')`` and compares item by
item, correctly, against narrow keys). Binary searches over slices
(:func:`common_blocks`) find where a query leaves a node in about one pass over the common part.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from types import MappingProxyType
from typing import TypeAlias, cast

from prefixkv.cache._checks import check_tokens
from prefixkv.cache.forest import EntryState
from prefixkv.cache.held_ids import BlockIds


class RadixNode(EntryState):
    """One edge of the tree: ``key`` tokens stored in ``blocks`` (``len(key) == len(blocks) * bs``).

    ``key`` is an ``array('H')`` or ``array('I')`` (see the module doc) and ``blocks`` an
    ``array('I')`` of ids (:data:`~prefixkv.cache.held_ids.BlockIds`: matches and evictions
    copy runs of it in C, and no Python int is kept per id), all stamped with the node's
    ``owner`` tag (shared with the other parts when the node was split; 0 for a root, which
    holds none).

    ``children`` maps a child's first token to that child, or, when several children start
    with it (block size above 1 only: they differ later in their first block), to a tuple of
    them (:func:`kids` reads either). A node without children shares one read-only empty
    mapping (:data:`NO_CHILDREN`), replaced by a dict of its own when its first child is added.
    """

    __slots__ = ("__weakref__", "blocks", "children", "is_root", "key", "owner", "parent",
                 "start_depth")

    def __init__(self, key: array[int], blocks: BlockIds, parent: RadixNode | None, now: float,
                 start_depth: int = 0, is_root: bool = False, owner: int = 0) -> None:
        super().__init__(now)
        self.key = key
        self.blocks = blocks
        self.owner = owner
        self.parent = parent
        self.children: dict[int, Child] = NO_CHILDREN
        self.start_depth = start_depth
        self.is_root = is_root

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
