"""HashPrefixCache: vLLM-style automatic prefix caching with chained block hashes.

Each full block is keyed by ``hash(parent_hash, block_tokens, extra_key)`` (see
:mod:`prefixkv.cache.hashing`); a lookup walks the query's blocks and stops at the first miss.

Collisions: every hit is *verified* - the stored block must have the same parent block, the
same tokens, the same extra key and the same namespace - so no hash algorithm, not even the 64-bit ``builtin``,
can ever return another prefix's KV. A colliding block is simply not cached.

Eviction: the blocks form a forest through their parents; only leaf blocks (no cached child)
that are unlocked and unpinned are evictable, ordered by the policy (LRU: least recent, deeper
first on ties, which is vLLM's free-queue order).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from prefixkv.cache._checks import check_tokens
from prefixkv.cache.hashing import check_key_part, make_block_hasher, root_hash
from prefixkv.cache.index_base import PrefixIndexBase, Walk
from prefixkv.cache.policies import EvictionPolicy
from prefixkv.cache.protection import is_evictable_leaf
from prefixkv.cache.protocol import Namespace, PrefixNode


class HashBlock:
    """One cached block: its chained hash, id, tokens, extra key and tree links."""

    __slots__ = (
        "access_count",
        "block_id",
        "children",
        "created_time",
        "depth",
        "extra",
        "hash",
        "heap_ver",
        "in_heap",
        "last_access_time",
        "lock_ref",
        "namespace",
        "num_blocks",
        "num_children",
        "parent",
        "pin_ref",
        "tick",
        "tokens",
    )
    is_root = False

    def __init__(self, h: Any, block_id: int, parent: HashBlock | None, tokens: list[int],
                 extra: Any, namespace: Namespace, depth: int, now: float) -> None:
        self.hash = h
        self.block_id = block_id
        self.parent = parent
        self.tokens = tokens
        self.extra = extra
        self.namespace = namespace
        self.children: dict[int, list[HashBlock]] | None = None
        self.num_children = 0
        self.lock_ref = 0
        self.pin_ref = 0
        self.last_access_time = now
        self.access_count = 0
        self.created_time = now
        self.tick = 0
        self.depth = depth
        self.num_blocks = 1
        self.heap_ver = 0
        self.in_heap = False

    @property
    def blocks(self) -> list[int]:
        """The block id, as a one-element list (same shape as a radix node's blocks)."""
        return [self.block_id]

    def __repr__(self) -> str:
        return f"HashBlock(id={self.block_id}, depth={self.depth}, lock={self.lock_ref})"


class HashPrefixCache(PrefixIndexBase):
    """Hash-table prefix index (vLLM APC). See :class:`prefixkv.cache.protocol.PrefixCache`.

    Args:
        max_blocks: size of the block-id space ``[0, max_blocks)``.
        block_size: tokens per block (default 16, vLLM's).
        hash_algo: ``"sha256"`` (default), ``"xxhash"`` or ``"builtin"``.
        eviction_policy, max_pinned_blocks, clock: as for the radix index.

    ``extra_keys`` gives one extra key per block (multimodal hashes); blocks with different
    extra keys never match. Namespaces must be None/int/str/bytes or tuples of those.
    """

    index_name = "hash"

    def __init__(
        self,
        max_blocks: int,
        block_size: int = 16,
        *,
        hash_algo: str = "sha256",
        eviction_policy: str | EvictionPolicy = "lru",
        max_pinned_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hasher = make_block_hasher(hash_algo)
        super().__init__(max_blocks, block_size, eviction_policy=eviction_policy,
                         max_pinned_blocks=max_pinned_blocks, clock=clock)
        self.hash_algo = hash_algo
        self._table: dict[Any, HashBlock] = {}
        self._roots: dict[Namespace, Any] = {}
        self._root_children: dict[Namespace, dict[int, list[HashBlock]]] = {}

    def _root(self, namespace: Namespace) -> Any:
        h = self._roots.get(namespace)
        if h is None:
            h = self._roots[namespace] = root_hash(self.hash_algo, namespace)
        return h

    def _check_extra(self, extra_keys: Any, n: int) -> Sequence[Any] | None:
        if extra_keys is None:
            return None
        if not isinstance(extra_keys, (list, tuple)):
            raise ValueError("extra_keys must be a list with one entry per block")  # noqa: TRY004
        full, ceil = n // self._bs, -(-n // self._bs)
        if len(extra_keys) not in (full, ceil):
            raise ValueError(
                f"extra_keys has {len(extra_keys)} entries but token_ids has {n} tokens = "
                f"{full} full blocks of {self._bs}"
            )
        for k in extra_keys:
            check_key_part(k, "extra_keys")
        return extra_keys

    # ------------------------------------------------------------------ walking
    def _walk(self, tokens: Sequence[int], n: int, namespace: Namespace, extra: Any) -> Walk:
        extra_keys = self._check_extra(extra, n if extra is None else len(tokens))
        if not isinstance(tokens, list):
            tokens = list(tokens)
        check_tokens(tokens)  # hashing reads every token anyway
        walk = Walk(ids=[], path=[], last_used=1)
        parent_hash = self._root(namespace)
        bs, table, hasher = self._bs, self._table, self._hasher
        prev: HashBlock | None = None
        j = 0
        for j in range(n // bs):
            blk = tokens[j * bs : (j + 1) * bs]
            ex = extra_keys[j] if extra_keys is not None else None
            h = hasher(parent_hash, blk, ex)
            e = table.get(h)
            if (e is None or e.parent is not prev or e.tokens != blk or e.extra != ex
                    or e.namespace != namespace):
                break
            walk.ids.append(e.block_id)
            walk.path.append(e)
            prev, parent_hash = e, h
        i = len(walk.ids) * bs
        if i < n and bs > 1:
            children = prev.children if prev is not None else self._root_children.get(namespace)
            lst = children.get(tokens[i]) if children else None
            if lst:
                ex = extra_keys[len(walk.ids)] if extra_keys is not None and len(
                    extra_keys) > len(walk.ids) else None
                limit = min(bs, n - i)
                best, best_e = 0, None
                for c in lst:
                    if c.extra != ex:
                        continue
                    p = 0
                    while p < limit and c.tokens[p] == tokens[i + p]:
                        p += 1
                    if p > best:
                        best, best_e = p, c
                if best_e is not None and best < bs:
                    walk.partial, walk.partial_entry, walk.partial_index = best, best_e, 0
        return walk

    def _cut(self, entry: HashBlock, k: int) -> HashBlock:
        return entry

    def _drop_tail(self, entry: HashBlock, k: int) -> list[int]:
        del self._table[entry.hash]
        parent = entry.parent
        children = parent.children if parent is not None else self._root_children[entry.namespace]
        assert children is not None
        siblings = children[entry.tokens[0]]
        siblings.remove(entry)
        if not siblings:
            del children[entry.tokens[0]]
        if parent is not None:
            parent.num_children -= 1
        entry.num_blocks = 0
        self._num_entries -= 1
        ids = [entry.block_id]
        self._ids.release(ids)
        return ids

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
        if not isinstance(tokens, list):
            tokens = list(tokens)  # hashing and the stored per-block tokens work on lists
        bs = self._bs
        with self._lock:
            ek = self._check_extra(extra_keys, len(tokens))
            w = self._walk(tokens, nb * bs, namespace, ek)
            m = len(w.ids)
            check_tokens(tokens[m * bs :])
            # hashes of the new blocks; stop at a collision with a different cached block
            parent_hash = w.path[-1].hash if w.path else self._root(namespace)
            new_hashes: list[Any] = []
            seen: set[Any] = set()
            for j in range(m, nb):
                ex = ek[j] if ek is not None else None
                parent_hash = self._hasher(parent_hash, tokens[j * bs : (j + 1) * bs], ex)
                if parent_hash in self._table or parent_hash in seen:  # a collision
                    break
                seen.add(parent_hash)
                new_hashes.append(parent_hash)
            stop = m + len(new_hashes)
            returned, _ = self._ids.claim(ids, w.ids, stop)  # last check: marks ids[m:stop] cached
            now = self._clock()
            # --- validated: mutate from here on
            prev = w.path[-1] if w.path else None
            path = w.path
            for off, h in enumerate(new_hashes):
                j = m + off
                blk = HashBlock(h, ids[j], prev, list(tokens[j * bs : (j + 1) * bs]),
                                ek[j] if ek is not None else None, namespace, j + 1, now)
                if prev is None:
                    children = self._root_children.setdefault(namespace, {})
                else:
                    if prev.children is None:
                        prev.children = {}
                    children = prev.children
                    prev.num_children += 1
                    self._prot.refresh(prev)
                children.setdefault(blk.tokens[0], []).append(blk)
                self._table[h] = blk
                self._num_entries += 1
                path.append(blk)
                prev = blk
            return self._finish_insert(tokens, nb, path, w.ids + ids[m:stop], returned, prev,
                                       pin, lock, namespace, now, description, shown)

    def _memory_bytes(self) -> int:
        per_block = (sys.getsizeof(HashBlock(0, 0, None, [], None, None, 0, 0.0))
                     + 56 + 8 * self._bs + 100 + 48)
        return self._num_entries * per_block

    def check_invariants(self) -> None:
        """Assert every structural invariant (tests and debugging)."""
        with self._lock:
            seen: set[int] = set()
            locked = pinned = protected = 0
            for h, e in self._table.items():
                assert e.hash == h and e.num_blocks == 1
                assert e.block_id not in seen
                seen.add(e.block_id)
                kids = sum(len(v) for v in e.children.values()) if e.children else 0
                assert kids == e.num_children
                if e.parent is not None:
                    assert e.parent.hash in self._table and e.depth == e.parent.depth + 1
                    assert e.lock_ref <= e.parent.lock_ref and e.pin_ref <= e.parent.pin_ref
                locked += e.lock_ref > 0
                pinned += e.pin_ref > 0
                protected += e.lock_ref > 0 or e.pin_ref > 0
                assert e.in_heap == is_evictable_leaf(e)
            assert seen == self._ids.as_set()
            assert (locked, pinned, protected) == (
                self._prot.locked_blocks, self._prot.pinned_blocks, self._prot.protected_blocks)
            assert len(self._table) == self._num_entries
