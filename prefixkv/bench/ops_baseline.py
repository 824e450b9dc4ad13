"""The baseline for ``prefixkv bench ops``: seed 004's reference radix tree, as written there.

Per-token Python matching, whole-tree scan on eviction, no locking or pinning budget. It is
the design the module spec starts from, so ratios against it show what the real indexes buy.
Benchmark use only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class _Node:
    __slots__ = (
        "children",
        "is_pinned",
        "kv_block_ids",
        "last_access_time",
        "parent",
        "ref_count",
        "token_ids",
    )

    def __init__(self, token_ids: list[int], kv_block_ids: list[int], parent: _Node | None) -> None:
        self.token_ids = token_ids
        self.kv_block_ids = kv_block_ids
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.ref_count = 0
        self.last_access_time = 0.0
        self.is_pinned = False


class SeedReferenceRadix:
    """Seed 004's ``RadixPrefixCache`` sketch (token granularity, one block id per token)."""

    def __init__(self) -> None:
        self.root = _Node([], [], None)

    def match_prefix(self, token_ids: Sequence[int]) -> int:
        """Number of leading tokens cached (per-token walk, as in the seed)."""
        node, i = self.root, 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            j = 0
            key = child.token_ids
            while j < len(key) and i < len(token_ids) and key[j] == token_ids[i]:
                i += 1
                j += 1
            child.last_access_time = time.monotonic()
            if j < len(key):
                break
            node = child
        return i

    def insert_prefix(self, token_ids: Sequence[int], kv_block_ids: Sequence[int]) -> None:
        """Insert with node split (per-token compare)."""
        node, i = self.root, 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                new = _Node(list(token_ids[i:]), list(kv_block_ids[i:]), node)
                new.last_access_time = time.monotonic()
                node.children[token_ids[i]] = new
                return
            j = 0
            key = child.token_ids
            while j < len(key) and i + j < len(token_ids) and key[j] == token_ids[i + j]:
                j += 1
            if j < len(key):
                upper = _Node(key[:j], child.kv_block_ids[:j], node)
                node.children[key[0]] = upper
                child.token_ids = key[j:]
                child.kv_block_ids = child.kv_block_ids[j:]
                child.parent = upper
                upper.children[child.token_ids[0]] = child
                child = upper
            node = child
            i += j

    def evict_lru(self, num_blocks: int) -> list[int]:
        """Collect every leaf, sort by last access, drop whole leaves (the seed's loop)."""
        leaves: list[_Node] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                leaves.append(n)
            stack.extend(n.children.values())
        leaves = [n for n in leaves if not n.is_pinned and n.ref_count == 0]
        leaves.sort(key=lambda n: n.last_access_time)
        out: list[int] = []
        for n in leaves:
            if len(out) >= num_blocks:
                break
            out.extend(n.kv_block_ids)
            assert n.parent is not None
            del n.parent.children[n.token_ids[0]]
        return out
