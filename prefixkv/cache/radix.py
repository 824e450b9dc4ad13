"""RadixPrefixCache: a path-compressed radix tree over token ids (SGLang's RadixAttention).

At ``block_size=1`` reuse is token exact (SGLang); above 1 the tree is page aligned: every
node holds a whole number of blocks, and a query is matched in whole blocks, plus the
``partial_tokens`` of the next block that equal a cached block (for row copying).

Nodes are split when a query or an insert diverges inside them. A split keeps the *lower*
part in the original node object (so a lock handle, which names the deepest locked node,
stays valid) and creates a new parent for the upper part, inheriting lock and pin counts.

Cost: a query is packed once into ``array('I')`` (:func:`as_token_array`), then a match
compares whole node keys with array-slice equality (C speed), so it is O(matched tokens) with a
small constant plus O(nodes on the path) Python steps. Eviction pops the policy's smallest
evictable leaf from a heap and frees its tail run of blocks in one step (see
:meth:`PrefixIndexBase.evict`): O(log n) per evicted node at every block size, never a scan.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from prefixkv.cache._checks import as_token_array, check_tokens
from prefixkv.cache.held_ids import Packed
from prefixkv.cache.index_base import PrefixIndexBase, Walk
from prefixkv.cache.policies import EvictionPolicy
from prefixkv.cache.protection import is_evictable_leaf
from prefixkv.cache.protocol import Namespace, PrefixNode


class RadixNode:
    """One edge of the tree: ``key`` tokens stored in ``blocks`` (``len(key) == len(blocks) * bs``).

    ``key`` is an ``array('I')`` (4 bytes a token, compared in C), ``blocks`` a list (matches
    extend their result from it without creating ints), and ``bids`` the same ids packed as an
    ``array('I')`` or a ``range`` when the node was created from a bulk claim (so eviction
    releases them in C), else ``None``.

    ``children`` maps a child's first token to the children starting with it (one child per
    token at block size 1; several may share a first token above 1, differing later in their
    first block).
    """

    __slots__ = (
        "__weakref__",
        "access_count",
        "bids",
        "blocks",
        "children",
        "created_time",
        "heap_ver",
        "in_heap",
        "is_root",
        "key",
        "last_access_time",
        "lock_ref",
        "num_children",
        "parent",
        "pin_ref",
        "start_depth",
        "tick",
    )

    def __init__(self, key: array[int], blocks: list[int], parent: RadixNode | None, now: float,
                 start_depth: int = 0, is_root: bool = False) -> None:
        self.key = key
        self.blocks = blocks
        self.bids: Packed | None = None  # the same ids packed (HeldIds.claim), for long runs
        self.parent = parent
        self.children: dict[int, list[RadixNode]] = {}
        self.num_children = 0
        self.lock_ref = 0
        self.pin_ref = 0
        self.last_access_time = now
        self.access_count = 0
        self.created_time = now
        self.tick = 0
        self.start_depth = start_depth
        self.heap_ver = 0
        self.in_heap = False
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


class RadixPrefixCache(PrefixIndexBase):
    """Radix-tree prefix index. See :class:`prefixkv.cache.protocol.PrefixCache` for contracts.

    Args:
        max_blocks: size of the block-id space ``[0, max_blocks)`` (the KV pool size).
        block_size: tokens per block (1 = token-exact reuse).
        eviction_policy: ``"lru"`` (default), ``"lfu"``, ``"fifo"`` or an ``EvictionPolicy``.
        max_pinned_blocks: pinned-block budget (default 20% of ``max_blocks``).
        clock: time source for recency (injectable for tests).

    ``extra_keys`` is not supported here (use ``namespace``); passing it is a ``ValueError``.
    """

    index_name = "radix"

    def __init__(
        self,
        max_blocks: int,
        block_size: int = 1,
        *,
        eviction_policy: str | EvictionPolicy = "lru",
        max_pinned_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_blocks, block_size, eviction_policy=eviction_policy,
                         max_pinned_blocks=max_pinned_blocks, clock=clock)
        self._roots: dict[Namespace, RadixNode] = {}
        self._cached_tokens = 0

    def _as_tokens(self, token_ids: Any) -> array[int]:
        """Queries are walked as ``array('I')``, the key type (see :func:`as_token_array`)."""
        return as_token_array(token_ids)

    # ------------------------------------------------------------------ walking
    def _walk(self, tokens: Sequence[int], n: int, namespace: Namespace, extra: Any) -> Walk:
        if extra is not None:
            raise ValueError("extra_keys is supported by HashPrefixCache only; use namespace")
        walk = Walk(ids=[], path=[], last_used=0)
        node = self._roots.get(namespace)
        if node is None:
            return walk
        bs = self._bs
        ids = walk.ids
        path = walk.path
        i = 0
        while i < n:
            lst = node.children.get(tokens[i])
            if lst is None:
                break
            if n - i < bs:  # a partial block left: only partial rows can match
                self._partial_at_boundary(lst, tokens, i, n, walk)
                break
            if len(lst) == 1:  # the common case: compare the whole key at once
                child = lst[0]
            else:
                head = _seg(tokens, i, i + bs)
                found = next((c for c in lst if c.key[:bs] == head), None)
                if found is None:
                    self._partial_at_boundary(lst, tokens, i, n, walk)
                    break
                child = found
            key = child.key
            klen = len(key)
            if i + klen <= n and _seg(tokens, i, i + klen) == key:
                path.append(child)
                ids.extend(child.blocks)
                walk.last_used = len(child.blocks)
                i += klen
                node = child
                continue
            k = _common_blocks(key, tokens, i, n, bs)
            if k == 0:  # not even the first block (bs > 1): partial rows at best
                self._partial_at_boundary(lst, tokens, i, n, walk)
                break
            path.append(child)
            ids.extend(child.blocks[:k])
            walk.last_used = k
            i += k * bs
            if bs > 1 and i < n and k < len(child.blocks):
                p = _lcp(key, k * bs, tokens, i, min(bs, n - i))
                if p:
                    walk.partial, walk.partial_entry, walk.partial_index = p, child, k
            break
        return walk

    def _partial_at_boundary(self, lst: list[RadixNode], tokens: Sequence[int], i: int, n: int,
                             walk: Walk) -> None:
        """No child's first block matches at ``i``: record the child sharing most leading rows."""
        if self._bs == 1:
            return
        best, best_c = 0, None
        for c in lst:
            p = _lcp(c.key, 0, tokens, i, min(self._bs, n - i))
            if p > best:
                best, best_c = p, c
        if best_c is not None and best < self._bs:
            walk.partial, walk.partial_entry, walk.partial_index = best, best_c, 0

    def _cut(self, entry: RadixNode, k: int) -> RadixNode:
        if k < len(entry.blocks):
            return self._split(entry, k)
        return entry

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split ``node`` after its ``k``-th block; returns the new upper node (its parent)."""
        bs = self._bs
        parent = node.parent
        assert parent is not None
        upper = RadixNode(node.key[: k * bs], node.blocks[:k], parent, node.last_access_time,
                          node.start_depth)
        upper.lock_ref = node.lock_ref
        upper.pin_ref = node.pin_ref
        upper.access_count = node.access_count
        upper.created_time = node.created_time
        upper.tick = node.tick
        if node.bids is not None:
            upper.bids = node.bids[:k]
            node.bids = node.bids[k:]
        siblings = parent.children[node.key[0]]
        siblings[siblings.index(node)] = upper
        node.key = node.key[k * bs :]
        node.blocks = node.blocks[k:]
        node.start_depth += k
        node.parent = upper
        upper.children[node.key[0]] = [node]
        upper.num_children = 1
        self._num_entries += 1
        # pinned prefixes that ended at `node`'s old end still end there; the registry names
        # the deepest node, so nothing to update. `node` keeps its heap membership and key.
        if node.in_heap:
            self._prot.heap.push(node)
        return upper

    def _drop_tail(self, entry: RadixNode, k: int) -> list[int]:
        blocks, bids = entry.blocks, entry.bids
        n = len(blocks)
        self._cached_tokens -= k * self._bs
        if k < n:
            ids = blocks[n - 1 : n - k - 1 : -1]  # deepest block first
            self._ids.release(ids, None if bids is None else bids[n - k :])
            del blocks[n - k :]
            if type(bids) is range:
                entry.bids = bids[: n - k]
            elif bids is not None:
                del bids[n - k :]
            del entry.key[(n - k) * self._bs :]
            return ids
        # the whole entry goes: no copies but the reversed id list (its key is left as is)
        self._ids.release(blocks, bids)
        entry.blocks, entry.bids = [], None
        parent = entry.parent
        assert parent is not None
        first_token = entry.key[0]
        siblings = parent.children[first_token]
        if len(siblings) == 1:
            del parent.children[first_token]
        else:
            siblings.remove(entry)
        parent.num_children -= 1
        self._num_entries -= 1
        blocks.reverse()  # deepest block first; the list is no longer the node's
        return blocks

    def _key_at(self, entry: Any, depth: int) -> Any:
        """The policy's key for ``entry`` cut to ``depth`` (its start depth moved, then put
        back: no probe object, and a key that reads ``start_depth`` sees the cut too)."""
        saved = entry.start_depth
        entry.start_depth = saved - (saved + len(entry.blocks) - depth)
        try:
            return self._policy.key(entry)
        finally:
            entry.start_depth = saved

    # ------------------------------------------------------------------- insert
    def _insert(
        self,
        tokens: Sequence[int],
        nb: int,
        ids: list[int],
        pin: bool,
        namespace: Namespace,
        extra_keys: Sequence[Hashable | None] | None,
        lock: bool,
        description: str | None,
        shown: Sequence[int],
    ) -> PrefixNode:
        with self._lock:
            w = self._walk(tokens, nb * self._bs, namespace, extra_keys)
            m = len(w.ids)
            new_key = _seg(tokens, m * self._bs, nb * self._bs)  # validates the new tokens
            check_tokens(tokens[nb * self._bs :])  # the trailing partial block, not stored
            returned, packed = self._ids.claim(ids, w.ids, nb)  # last check: marks ids[m:]
            now = self._clock()
            # --- validated: mutate from here on
            root = self._roots.get(namespace)
            if root is None:
                root = self._roots[namespace] = RadixNode(array("I"), [], None, now, is_root=True)
            if w.path:
                last = w.path[-1]
                if w.last_used < len(last.blocks):
                    last = self._split(last, w.last_used)
                    w.path[-1] = last
                attach = last
            else:
                attach = root
            target = attach if w.path else None
            if m < nb:
                new_ids = ids[m:]
                node = RadixNode(new_key, new_ids, attach, now, start_depth=m)
                node.bids = packed
                attach.children.setdefault(node.key[0], []).append(node)
                attach.num_children += 1
                self._num_entries += 1
                self._prot.refresh(attach)
                self._cached_tokens += len(node.key)
                w.path.append(node)
                target = node
            return self._finish_insert(tokens, nb, w.path, w.ids + ids[m:], returned, target,
                                       pin, lock, namespace, now, description, shown)

    def _memory_bytes(self) -> int:
        node_size = sys.getsizeof(RadixNode(array("I"), [], None, 0.0)) + 64 + 56 + 64 + 232
        return (self._num_entries * node_size + self._cached_tokens * 4 + self._ids.count * 8
                + self._max_blocks)

    def check_invariants(self) -> None:
        """Walk the whole tree and assert every structural invariant (tests and debugging)."""
        with self._lock:
            seen: set[int] = set()
            locked = pinned = protected = entries = 0
            for root in self._roots.values():
                stack = [root]
                while stack:
                    node = stack.pop()
                    n_children = sum(len(v) for v in node.children.values())
                    assert n_children == node.num_children, "num_children out of sync"
                    for t, lst in node.children.items():
                        for c in lst:
                            assert c.parent is node and c.key[0] == t and c.blocks
                            assert len(c.key) == len(c.blocks) * self._bs
                            assert c.start_depth == node.depth if not node.is_root else c.start_depth == 0
                            assert c.lock_ref <= node.lock_ref or node.is_root
                            assert c.pin_ref <= node.pin_ref or node.is_root
                            stack.append(c)
                    if node.is_root:
                        continue
                    entries += 1
                    for b in node.blocks:
                        assert b not in seen, f"block {b} cached twice"
                        seen.add(b)
                    if node.lock_ref:
                        locked += len(node.blocks)
                    if node.pin_ref:
                        pinned += len(node.blocks)
                    if node.lock_ref or node.pin_ref:
                        protected += len(node.blocks)
                    assert node.in_heap == (is_evictable_leaf(node)), "heap out of sync"
            assert seen == self._ids.as_set(), "cached id flags out of sync"
            assert (locked, pinned, protected) == (
                self._prot.locked_blocks, self._prot.pinned_blocks, self._prot.protected_blocks)
            assert entries == self._num_entries


def _seg(tokens: Sequence[int], start: int, stop: int) -> array[int]:
    """``tokens[start:stop]`` as an ``array('I')`` (a slice if ``tokens`` already is one).

    Converting also validates: a non-int raises ``ValueError``, and so does a negative or
    too large (>= 2**32) token id.
    """
    if type(tokens) is array and tokens.typecode == "I":
        return tokens[start:stop]
    seg = tokens[start:stop]
    try:
        return array("I", seg)
    except (TypeError, OverflowError):
        check_tokens(seg)  # raises the precise ValueError
        raise


def _lcp(key: array[int], start: int, tokens: Sequence[int], i: int, limit: int) -> int:
    """Length of the common prefix of ``key[start:]`` and ``tokens[i:]``, at most ``limit``."""
    p = 0
    stop = min(limit, len(key) - start)
    while p < stop and key[start + p] == tokens[i + p]:
        p += 1
    return p


def _common_blocks(key: array[int], tokens: Sequence[int], i: int, n: int, bs: int) -> int:
    """Largest k with ``tokens[i:i+k*bs] == key[:k*bs]``.

    Binary search in which each probe compares only the not-yet-verified segment
    ``[lo, mid)``, so the total work is about one pass over the common prefix (at C speed).
    """
    lo, hi = 0, min(len(key), n - i) // bs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _seg(tokens, i + lo * bs, i + mid * bs) == key[lo * bs : mid * bs]:
            lo = mid
        else:
            hi = mid - 1
    return lo
