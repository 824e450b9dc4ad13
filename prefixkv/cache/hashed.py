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
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prefixkv.cache._checks import as_token_list, check_tokens
from prefixkv.cache.evictable import EvictableHeap
from prefixkv.cache.eviction import WholeLeaves, key_at_depth
from prefixkv.cache.forest import Added, Claim, EntryState, ExtraKeys, Share, Walk, unbound_share
from prefixkv.cache.hashing import BlockHasher, check_key_part, make_block_hasher, root_hash
from prefixkv.cache.held_ids import ID_TYPECODE, BlockIds, HeldIds
from prefixkv.cache.index import PrefixIndex
from prefixkv.cache.policies import EvictionPolicy
from prefixkv.cache.protocol import Namespace


class HashBlock(EntryState):
    """One cached block: its chained hash, id, tokens, extra key and tree links."""

    __slots__ = ("block_id", "children", "depth", "extra", "hash", "namespace", "num_blocks",
                 "parent", "tokens")
    is_root = False
    owner = 0

    def __init__(self, h: Any, block_id: int, parent: HashBlock | None, tokens: list[int],
                 extra: Any, namespace: Namespace, depth: int, now: float) -> None:
        super().__init__(now)
        self.hash = h
        self.block_id = block_id
        self.parent = parent
        self.tokens = tokens
        self.extra = extra
        self.namespace = namespace
        self.children: dict[int, list[HashBlock]] | None = None
        self.depth = depth
        self.num_blocks = 1

    @property
    def blocks(self) -> list[int]:
        """The block id, as a one-element list (same shape as a radix node's blocks)."""
        return [self.block_id]

    def __repr__(self) -> str:
        return f"HashBlock(id={self.block_id}, depth={self.depth}, lock={self.lock_ref})"


class HashForest:
    """The hash table of one index: chained block hashes, every hit verified (module doc)."""

    name = "hash"

    def __init__(self, block_size: int, hash_algo: str) -> None:
        self.hasher = make_block_hasher(hash_algo)
        self.hash_algo = hash_algo
        self._bs = block_size
        self._table: dict[Any, HashBlock] = {}
        self._roots: dict[Namespace, Any] = {}
        self._root_children: dict[Namespace, dict[int, list[HashBlock]]] = {}
        self.share: Share = unbound_share  # never called: blocks are not split

    @property
    def num_entries(self) -> int:
        """Blocks held."""
        return len(self._table)

    def root(self, namespace: Namespace) -> Any:
        """The root hash of ``namespace`` (the parent hash of its first blocks)."""
        h = self._roots.get(namespace)
        if h is None:
            h = self._roots[namespace] = root_hash(self.hash_algo, namespace)
        return h

    def as_tokens(self, token_ids: Any) -> Sequence[int]:
        """A list (hashing and the stored per-block tokens work on lists), or an array as is."""
        return as_token_list(token_ids)

    def as_query(self, token_ids: Any) -> Sequence[int]:
        """A query for :meth:`walk`: the same as :meth:`as_tokens`."""
        return self.as_tokens(token_ids)

    def _check_extra(self, extra_keys: ExtraKeys, n: int) -> ExtraKeys:
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
    def walk(self, tokens: Sequence[int], n: int, namespace: Namespace,
             extra_keys: ExtraKeys) -> Walk[HashBlock]:
        """Follow the query's chained hashes to the first miss (see :class:`Forest`)."""
        extra = self._check_extra(extra_keys, len(tokens))
        if not isinstance(tokens, list):
            tokens = list(tokens)
        check_tokens(tokens)  # hashing reads every token anyway
        walk: Walk[HashBlock] = Walk(last_used=1)
        parent_hash = self.root(namespace)
        bs, table, hasher = self._bs, self._table, self.hasher
        prev: HashBlock | None = None
        for j in range(n // bs):
            blk = tokens[j * bs : (j + 1) * bs]
            ex = extra[j] if extra is not None else None
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
            self._partial(tokens, i, n, prev, namespace, extra, walk)
        return walk

    def _partial(self, tokens: list[int], i: int, n: int, prev: HashBlock | None,
                 namespace: Namespace, extra: ExtraKeys, walk: Walk[HashBlock]) -> None:
        """Record the child of ``prev`` sharing most leading rows with ``tokens[i:]``."""
        children = prev.children if prev is not None else self._root_children.get(namespace)
        lst = children.get(tokens[i]) if children else None
        if not lst:
            return
        j = len(walk.ids)
        ex = extra[j] if extra is not None and len(extra) > j else None
        limit = min(self._bs, n - i)
        best, best_e = 0, None
        for c in lst:
            if c.extra != ex:
                continue
            p = 0
            while p < limit and c.tokens[p] == tokens[i + p]:
                p += 1
            if p > best:
                best, best_e = p, c
        if best_e is not None and best < self._bs:
            walk.partial, walk.partial_entry, walk.partial_index = best, best_e, 0

    # ----------------------------------------------------------------- changing
    def cut(self, entry: HashBlock, k: int) -> HashBlock:
        """A block is never split: it holds one block and ``k >= 1``."""
        return entry

    def add(self, tokens: Sequence[int], nb: int, walk: Walk[HashBlock], namespace: Namespace,
            extra_keys: ExtraKeys, claim: Claim, now: float) -> Added[HashBlock]:
        """Store one block per new position, stopping at a hash collision (see :class:`Forest`)."""
        if not isinstance(tokens, list):
            tokens = list(tokens)
        bs = self._bs
        ek = self._check_extra(extra_keys, len(tokens))
        m = len(walk.ids)
        check_tokens(tokens[m * bs :])
        # hashes of the new blocks; stop at a collision with a different cached block
        parent_hash = walk.path[-1].hash if walk.path else self.root(namespace)
        new_hashes: list[Any] = []
        seen: set[Any] = set()
        for j in range(m, nb):
            ex = ek[j] if ek is not None else None
            parent_hash = self.hasher(parent_hash, tokens[j * bs : (j + 1) * bs], ex)
            if parent_hash in self._table or parent_hash in seen:  # a collision
                break
            seen.add(parent_hash)
            new_hashes.append(parent_hash)
        stop = m + len(new_hashes)
        taken, _ = claim(stop)  # blocks are released one by one: no tag of their own
        # --- validated: change from here on
        prev = walk.path[-1] if walk.path else None
        added = Added(walk.path, walk.ids + taken, prev)
        for off, h in enumerate(new_hashes):
            j = m + off
            blk = HashBlock(h, taken[off], prev, list(tokens[j * bs : (j + 1) * bs]),
                            ek[j] if ek is not None else None, namespace, j + 1, now)
            if prev is None:
                children = self._root_children.setdefault(namespace, {})
            else:
                if prev.children is None:
                    prev.children = {}
                children = prev.children
                prev.num_children += 1
                added.refile.append(prev)
            children.setdefault(blk.tokens[0], []).append(blk)
            self._table[h] = blk
            added.path.append(blk)
            prev = blk
        added.target = prev
        return added

    def drop_tail(self, entry: HashBlock, k: int) -> BlockIds:
        """Remove an evictable leaf block (``k`` is 1) and its table entry."""
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
        return array(ID_TYPECODE, (entry.block_id,))

    def whole_leaves(self, heap: EvictableHeap, held: HeldIds,
                     policy: EvictionPolicy) -> WholeLeaves | None:
        """No C runner: a chain's blocks are single entries (the Python loop frees them)."""
        return None

    def key_at(self, policy: EvictionPolicy, entry: HashBlock, depth: int) -> Any:
        """The generic probe (a block's run is never longer than one, so this is rare)."""
        return key_at_depth(policy, entry, depth)

    # -------------------------------------------------------------- inspection
    def entries(self, namespace: Namespace) -> Iterator[HashBlock]:
        """The blocks of ``namespace``, parents first."""
        stack = [b for kids in self._root_children.get(namespace, {}).values() for b in kids]
        while stack:
            blk = stack.pop()
            yield blk
            if blk.children:
                for kids in blk.children.values():
                    stack.extend(kids)

    def memory_bytes(self) -> int:
        """Blocks, their token lists (8 bytes a token) and table slots."""
        per_block = (sys.getsizeof(HashBlock(0, 0, None, [], None, None, 0, 0.0))
                     + 56 + 8 * self._bs + 100 + 48)
        return len(self._table) * per_block

    def check(self) -> Iterator[HashBlock]:
        """Assert the table's shape (hash keys, child counts, depths); yield every block."""
        for h, e in self._table.items():
            assert e.hash == h and e.num_blocks == 1
            kids = sum(len(v) for v in e.children.values()) if e.children else 0
            assert kids == e.num_children
            if e.parent is not None:
                assert e.parent.hash in self._table and e.depth == e.parent.depth + 1
            yield e


class HashPrefixCache(PrefixIndex[HashBlock]):
    """Hash-table prefix index (vLLM APC). See :class:`prefixkv.cache.protocol.PrefixCache`.

    Args:
        max_blocks: size of the block-id space ``[0, max_blocks)``.
        block_size: tokens per block (default 16, vLLM's).
        hash_algo: ``"sha256"`` (default), ``"xxhash"`` or ``"builtin"``.
        eviction_policy, max_pinned_blocks, clock, max_blocks_per_tenant: as for the radix
            index.

    ``extra_keys`` gives one extra key per block (multimodal hashes); blocks with different
    extra keys never match. Namespaces must be None/int/str/bytes or tuples of those.
    """

    def __init__(
        self,
        max_blocks: int,
        block_size: int = 16,
        *,
        hash_algo: str = "sha256",
        eviction_policy: str | EvictionPolicy = "lru",
        max_pinned_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_blocks_per_tenant: int | None = None,
    ) -> None:
        self._hash_forest = HashForest(block_size, hash_algo)
        super().__init__(self._hash_forest, max_blocks, block_size,
                         eviction_policy=eviction_policy, max_pinned_blocks=max_pinned_blocks,
                         clock=clock, max_blocks_per_tenant=max_blocks_per_tenant)
        self.hash_algo = hash_algo

    @property
    def _hasher(self) -> BlockHasher:
        """The block hash function (tests swap it to force collisions)."""
        return self._hash_forest.hasher

    @_hasher.setter
    def _hasher(self, fn: BlockHasher) -> None:
        self._hash_forest.hasher = fn

    def _root(self, namespace: Namespace) -> Any:
        """The root hash of ``namespace``."""
        return self._hash_forest.root(namespace)
