"""RadixPrefixCache: a path-compressed radix tree over token ids (SGLang's RadixAttention).

At ``block_size=1`` reuse is token exact (SGLang); above 1 the tree is page aligned: every
node holds a whole number of blocks, and a query is matched in whole blocks, plus the
``partial_tokens`` of the next block that equal a cached block (for row copying).

:class:`RadixForest` is the tree's shape (walk, split, add, drop a tail), driven by
:class:`~prefixkv.cache.index.PrefixIndex`; :class:`RadixPrefixCache` is the two put together.
Nodes are split when a query or an insert diverges inside them. A split keeps the *lower*
part in the original node object (so a lock handle, which names the deepest locked node,
stays valid) and creates a new parent for the upper part, inheriting lock and pin counts.

Keys are ``array('H')`` (2 bytes a token) while every cached token id is below 2**16 (GPT-2,
Llama 2, Mistral, Phi-3 vocabularies), widened once when a larger id is first inserted (Llama 3,
Qwen, DeepSeek vocabularies): to 18-bit packed ``bytes`` (2.25 bytes a token) when the block
size is a multiple of 4 and the C helper is built, else to ``array('I')`` (see
:mod:`~prefixkv.cache.radix_node`).

Cost: a query is packed once into the key's form (:func:`as_token_array`, then 18 bits a token
for packed keys: about 0.6 us for 2,048 ids), then a match
compares whole node keys with array-slice equality (C speed), so it is O(matched tokens) with a
small constant plus O(nodes on the path) Python steps. Eviction frees a leaf's tail run of
blocks in one step (:mod:`prefixkv.cache.eviction`): O(log n) per evicted node, never a scan.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prefixkv.cache._checks import as_token_array, check_tokens
from prefixkv.cache._native import evict as _evict  # None: the Python loop only
from prefixkv.cache._native import keypack as _keypack
from prefixkv.cache.evictable import EvictableHeap
from prefixkv.cache.eviction import WholeLeaves
from prefixkv.cache.forest import Added, Claim, ExtraKeys, Share, Walk, unbound_share
from prefixkv.cache.held_ids import ID_TYPECODE, BlockIds, HeldIds, new_ids
from prefixkv.cache.index import PrefixIndex
from prefixkv.cache.policies import EvictionPolicy
from prefixkv.cache.protocol import Namespace
from prefixkv.cache.radix_node import (
    NO_CHILDREN,
    PACKED,
    Key,
    RadixNode,
    common_blocks,
    common_packed_blocks,
    first_token,
    key_tokens,
    kids,
    lcp,
    pack,
    packed_len,
    seg,
)

_NODE_BYTES = sys.getsizeof(RadixNode(array("I"), new_ids(), None, 0.0)) + 80 + 80 + 64 + 232
"""Estimated bytes of a node beyond its tokens and ids (tracemalloc: about 600-700 at block
size 16): the object, its key and id arrays' headers, its slot and first token in its parent's
dict, its heap item with the policy's key, its owner tags, and its access time and tick."""

_TOKEN_BYTES = {"H": 2.0, "I": 4.0, "P": 2.25}
"""Key bytes a token for each key code."""


_DETACHED = new_ids()
"""The (empty) ids of every evicted node, shared: a detached node is never changed again."""


class RadixForest:
    """The radix tree of one index: one root sentinel per namespace (see module doc)."""

    name = "radix"

    def __init__(self, block_size: int) -> None:
        self._bs = block_size
        self._roots: dict[Namespace, RadixNode] = {}
        self._num_entries = 0
        self._cached_tokens = 0
        self._code = "H"  # the key code: uint16 until an id >= 2**16 is inserted, then P or I
        self._packs = PACKED and block_size % 4 == 0  # packed keys possible (whole groups of 4)
        self.share: Share = unbound_share

    @property
    def num_entries(self) -> int:
        """Nodes held (roots excluded)."""
        return self._num_entries

    @property
    def key_typecode(self) -> str:
        """``"H"`` (2 bytes a token) until an id >= 2**16 is inserted, then ``"P"`` (18-bit
        packed) or ``"I"`` (4 bytes; see the module doc)."""
        return self._code

    def as_tokens(self, token_ids: Any) -> array[int]:
        """Queries are walked in the key type where they fit (see :func:`as_token_array`)."""
        return as_token_array(token_ids, narrow=self._code == "H")

    def as_query(self, token_ids: Any) -> Sequence[int]:
        """:meth:`as_tokens`, except that a tree of packed keys walks a 64-bit int array (SGLang's
        ``array('q')``) as it is once one C pass checked its values: :meth:`walk` packs it
        straight from the int64 buffer (2,048 ids: about 0.25 us instead of 0.95 to narrow
        them into a new array first)."""
        if (self._code == "P" and type(token_ids) is array and token_ids.itemsize == 8
                and token_ids.typecode in "qQlL" and token_ids and _keypack is not None
                and _keypack.fits32(token_ids)):
            return token_ids
        return self.as_tokens(token_ids)

    # ------------------------------------------------------------------ walking
    def walk(self, tokens: Sequence[int], n: int, namespace: Namespace,
             extra_keys: ExtraKeys) -> Walk[RadixNode]:
        """Match ``tokens[:n]`` down from the namespace's root (see :class:`Forest`)."""
        if extra_keys is not None:
            raise ValueError("extra_keys is supported by HashPrefixCache only; use namespace")
        walk: Walk[RadixNode] = Walk()
        node = self._roots.get(namespace)
        if node is None:
            return walk
        bs = self._bs
        ids = walk.ids
        path = walk.path
        # a query packed in the key's form is compared as raw bytes, without slicing it: a
        # node's key matches at i when raw[i * num // den:] starts with the key's bytes
        code = self._code
        packed = code == "P"
        if packed:  # (whole groups of 4 before any id >= 2**18: a shorter raw matches less)
            raw: bytes | None = pack(tokens, 0, n)  # type: ignore[arg-type]
            num, den = 9, 4
        else:
            raw = tokens.tobytes() if type(tokens) is array and tokens.typecode == code else None
            num, den = (2 if code == "H" else 4), 1
        i = 0
        while i < n:
            found = node.children.get(tokens[i])
            if found is None:
                break
            if n - i < bs:  # a partial block left: only partial rows can match
                self._partial_at_boundary(kids(found), tokens, i, n, walk)
                break
            if isinstance(found, RadixNode):  # the common case: compare the whole key at once
                child = found
            else:
                hb = bs * num // den if packed else bs  # the first block's key length
                o = i * num // den
                head = raw[o : o + hb] if packed else seg(tokens, i, i + bs)  # type: ignore[index]
                same = next((c for c in found if c.key[:hb] == head), None)
                if same is None:
                    self._partial_at_boundary(found, tokens, i, n, walk)
                    break
                child = same
            key = child.key
            klen = len(child.blocks) * bs
            if i + klen <= n and (raw.startswith(key, i * num // den) if raw is not None
                                  else seg(tokens, i, i + klen) == key):
                path.append(child)
                ids += child.blocks
                walk.last_used = len(child.blocks)
                i += klen
                node = child
                continue
            k = (common_packed_blocks(raw, i * num // den, key, bs * num // den)  # type: ignore[arg-type]
                 if packed else common_blocks(key, tokens, i, n, bs))  # type: ignore[arg-type]
            if k == 0:  # not even the first block (bs > 1): partial rows at best
                self._partial_at_boundary(kids(found), tokens, i, n, walk)
                break
            path.append(child)
            ids += child.blocks[:k]
            walk.last_used = k
            i += k * bs
            if bs > 1 and i < n and k < len(child.blocks):
                p = lcp(key_tokens(key, k * bs, (k + 1) * bs), 0, tokens, i, min(bs, n - i))
                if p:
                    walk.partial, walk.partial_entry, walk.partial_index = p, child, k
            break
        return walk

    def _partial_at_boundary(self, lst: tuple[RadixNode, ...], tokens: Sequence[int], i: int, n: int,
                             walk: Walk[RadixNode]) -> None:
        """No child's first block matches at ``i``: record the child sharing most leading rows."""
        if self._bs == 1:
            return
        best, best_c = 0, None
        for c in lst:
            p = lcp(key_tokens(c.key, 0, self._bs), 0, tokens, i, min(self._bs, n - i))
            if p > best:
                best, best_c = p, c
        if best_c is not None and best < self._bs:
            walk.partial, walk.partial_entry, walk.partial_index = best, best_c, 0

    # ----------------------------------------------------------------- changing
    def cut(self, entry: RadixNode, k: int) -> RadixNode:
        """``entry`` itself if it ends at its ``k``-th block, else the upper part of a split."""
        if k < len(entry.blocks):
            return self._split(entry, k)
        return entry

    def _key_offset(self, k: int) -> int:
        """Where a key's ``k``-th block starts: in bytes for packed keys, else in tokens."""
        return k * self._bs * 9 // 4 if self._code == "P" else k * self._bs

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split ``node`` after its ``k``-th block; returns the new upper node (its parent)."""
        cut = self._key_offset(k)
        parent = node.parent
        assert parent is not None
        upper = RadixNode(node.key[:cut], node.blocks[:k], parent, node.last_access_time,
                          node.start_depth)
        upper.lock_ref = node.lock_ref
        upper.pin_ref = node.pin_ref
        upper.retention = node.retention  # the same blocks, so the retained count stands
        upper.access_count = node.access_count
        upper.created_time = node.created_time
        upper.tick = node.tick
        first = first_token(node.key)
        found = parent.children[first]
        parent.children[first] = upper if found is node else tuple(
            upper if c is node else c for c in kids(found))
        node.key = node.key[cut:]
        node.blocks = node.blocks[k:]
        upper.owner = self.share(node.owner, upper.blocks)  # both parts hold the tag's ids
        node.start_depth += k
        node.parent = upper
        upper.children = {first_token(node.key): node}
        upper.num_children = 1
        self._num_entries += 1
        # pinned prefixes that ended at `node`'s old end still end there: the registry names
        # the deepest node, so nothing to update
        return upper

    def add(self, tokens: Sequence[int], nb: int, walk: Walk[RadixNode], namespace: Namespace,
            extra_keys: ExtraKeys, claim: Claim, now: float) -> Added[RadixNode]:
        """Store the blocks beyond ``walk`` as one new node (see :class:`Forest`)."""
        bs = self._bs
        m = len(walk.ids)
        new_tokens = seg(tokens, m * bs, nb * bs)  # validates the new tokens
        check_tokens(tokens[nb * bs :])  # the trailing partial block, not stored
        taken, owner = claim(nb)
        # --- validated: change from here on
        new_key = self._as_key(new_tokens)
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode(array("I"), new_ids(), None, now)
        path = walk.path
        added = Added(path, walk.ids + taken, None)
        if path:
            last = path[-1]
            if walk.last_used < len(last.blocks):
                added.refile.append(last)  # the lower part of the split below
                path[-1] = last = self._split(last, walk.last_used)
            attach = added.target = last
        else:
            attach = root
        if m < nb:
            node = RadixNode(new_key, taken, attach, now, start_depth=m, owner=owner)
            if attach.children is NO_CHILDREN:
                attach.children = {}
            first = first_token(new_key)
            found = attach.children.get(first)
            attach.children[first] = node if found is None else (*kids(found), node)
            attach.num_children += 1
            self._num_entries += 1
            self._cached_tokens += (nb - m) * bs
            path.append(node)
            added.target = node
            added.refile.append(attach)
        return added

    def drop_tail(self, entry: RadixNode, k: int) -> BlockIds:
        """Remove an evictable leaf's last ``k`` blocks, detaching it when none are left."""
        blocks = entry.blocks
        n = len(blocks)
        self._cached_tokens -= k * self._bs
        if k < n:
            ids = blocks[n - k :]
            del blocks[n - k :]
            if isinstance(entry.key, bytes):
                entry.key = entry.key[: self._key_offset(n - k)]
            else:
                del entry.key[(n - k) * self._bs :]
            return ids
        # the whole entry goes: no copies (its id array is handed over, its key left as is)
        entry.blocks = _DETACHED
        parent = entry.parent
        assert parent is not None
        first = first_token(entry.key)
        found = parent.children.pop(first)
        if found is not entry:
            rest = tuple(c for c in kids(found) if c is not entry)
            parent.children[first] = rest[0] if len(rest) == 1 else rest
        parent.num_children -= 1
        self._num_entries -= 1
        return blocks  # no longer the node's

    def _as_key(self, new: array[int]) -> Key:
        """Validated new tokens in the tree's key form, widening every key first when they
        need it (an id >= 2**16 in a 2-byte tree, or >= 2**18 in a packed one)."""
        code = self._code
        if code == "H":
            if new.typecode == "H":
                return new
            if not new or max(new) <= 0xFFFF:  # a query holding an id >= 2**16 elsewhere
                return array("H", new)
            self._widen("P" if self._packs and max(new) < 1 << 18 else "I")
            code = self._code
        if code == "P":
            packed = pack(new, 0, len(new))
            if packed_len(packed) == len(new):
                return packed
            self._widen("I")
        return new if new.typecode == "I" else array("I", new)

    def _widen(self, code: str) -> None:
        """Store every key in form ``code`` (``"P"`` from ``"H"``; ``"I"`` from either) from
        now on (at most twice per tree; O(cached tokens) each)."""
        self._code = code
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                key = node.key
                if code == "P":
                    node.key = pack(key, 0, len(key))  # type: ignore[arg-type]
                else:
                    node.key = key_tokens(key) if type(key) is bytes else array("I", key)
                for found in node.children.values():
                    stack.extend(kids(found))

    def whole_leaves(self, heap: EvictableHeap, held: HeldIds,
                     policy: EvictionPolicy) -> WholeLeaves | None:
        """The C runner of common whole-leaf eviction steps over this tree (``_evict.c``), or
        ``None`` without the helper or for a policy it cannot order
        (:meth:`~prefixkv.cache.policies.EvictionPolicy.frees_whole_leaves_in_c`)."""
        if _evict is None or not policy.frees_whole_leaves_in_c():
            return None
        runner = _evict.Runner(heap, held, self, RadixNode, _DETACHED, self._bs)
        return runner.run

    def key_at(self, policy: EvictionPolicy, entry: RadixNode, depth: int) -> Any:
        """The policy's key for ``entry`` cut to ``depth`` (its start depth moved, then put
        back: no probe object, and a key that reads ``start_depth`` sees the cut too)."""
        saved = entry.start_depth
        entry.start_depth = depth - len(entry.blocks)
        try:
            return policy.key(entry)
        finally:
            entry.start_depth = saved

    # -------------------------------------------------------------- inspection
    def entries(self, namespace: Namespace) -> Iterator[RadixNode]:
        """The nodes of ``namespace``'s tree, parents first."""
        root = self._roots.get(namespace)
        stack = [] if root is None else [root]
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            for found in node.children.values():
                stack.extend(kids(found))

    def memory_bytes(self) -> int:
        """Nodes, their keys (2, 2.25 packed, or 4 bytes a token) and id arrays (4 bytes an
        id)."""
        return (self._num_entries * _NODE_BYTES
                + int(self._cached_tokens * _TOKEN_BYTES[self._code])
                + self._cached_tokens // self._bs * 4)

    def check(self) -> Iterator[RadixNode]:
        """Assert the tree's shape (links, key lengths, depths); yield every node."""
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                assert sum(len(kids(v)) for v in node.children.values()) == node.num_children
                for t, found in node.children.items():
                    assert isinstance(found, RadixNode) or len(found) > 1
                    for c in kids(found):
                        assert c.parent is node and first_token(c.key) == t and c.blocks
                        if self._code == "P":
                            assert type(c.key) is bytes and len(c.key) % 9 == 0
                        else:
                            assert c.key.typecode == self._code  # type: ignore[union-attr]
                        assert len(key_tokens(c.key)) == len(c.blocks) * self._bs
                        assert c.start_depth == (0 if node.is_root else node.depth)
                        stack.append(c)
                if not node.is_root:
                    yield node


class RadixPrefixCache(PrefixIndex[RadixNode]):
    """Radix-tree prefix index. See :class:`prefixkv.cache.protocol.PrefixCache` for contracts.

    Args:
        max_blocks: size of the block-id space ``[0, max_blocks)`` (the KV pool size).
        block_size: tokens per block (1 = token-exact reuse).
        eviction_policy: ``"lru"`` (default), ``"lfu"``, ``"fifo"`` or an ``EvictionPolicy``.
        max_pinned_blocks: pinned-block budget (default 20% of ``max_blocks``).
        clock: time source for recency and retention expiries (injectable for tests).
        max_blocks_per_tenant: the most blocks a namespace may retain (``None``: no cap).

    ``extra_keys`` is not supported here (use ``namespace``); passing it is a ``ValueError``.
    """

    def __init__(
        self,
        max_blocks: int,
        block_size: int = 1,
        *,
        eviction_policy: str | EvictionPolicy = "lru",
        max_pinned_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_blocks_per_tenant: int | None = None,
    ) -> None:
        super().__init__(RadixForest(block_size), max_blocks, block_size,
                         eviction_policy=eviction_policy, max_pinned_blocks=max_pinned_blocks,
                         clock=clock, max_blocks_per_tenant=max_blocks_per_tenant)
