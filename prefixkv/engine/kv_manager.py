"""KVManager: the engine's side of the block ownership table (pool + prefix index).

It owns the :class:`~prefixkv.cache.block_pool.BlockPool` and uses the prefix index (or none,
with prefix caching off). For every sequence it keeps this invariant:

==============================  ================================================================
``block_table[:num_indexed]``   held by the index, locked by ``seq.cache_handle`` (never freed
                                here; unlocking makes them evictable, deepest first)
``block_table[num_indexed:]``   private to the sequence: freed here on release
==============================  ================================================================

So once no sequence holds blocks, ``pool.num_free + cache.num_cached_blocks == num_blocks``.
Pure Python; copying KV rows is a callable passed in (the runner's ``copy_block_rows``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from prefixkv.cache.block_pool import BlockPool
from prefixkv.cache.protocol import PinnedPrefix, PrefixCache
from prefixkv.engine.sequence import Sequence

CopyRows = Callable[[int, int, int], None]
"""``copy_rows(src_block, dst_block, num_rows)``: copy the first rows of a KV block."""


class KVManager:
    """Allocates, shares and releases the KV blocks of sequences. Single-threaded (engine loop)."""

    def __init__(
        self, num_blocks: int, block_size: int, cache: PrefixCache | None, copy_rows: CopyRows
    ) -> None:
        if cache is not None and cache.block_size != block_size:
            raise ValueError(
                f"cache block_size {cache.block_size} != engine block_size {block_size}"
            )
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.cache = cache
        self._copy_rows = copy_rows

    @property
    def num_blocks(self) -> int:
        """Size of the KV pool."""
        return self.pool.num_blocks

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation could get now: free plus evictable."""
        evictable = self.cache.num_evictable_blocks if self.cache is not None else 0
        return self.pool.num_free + evictable

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def admit(self, seq: Sequence, max_new_tokens: int) -> int | None:
        """Give a waiting sequence its cached prefix and the blocks for its first chunk.

        Matches ``token_ids[:-1]`` (so at least one token is computed), locks the match, copies
        the partial block's matching rows into a fresh block, and allocates blocks for up to
        ``max_new_tokens`` more tokens. Returns how many tokens to compute this step, or
        ``None`` (and nothing held) when the blocks cannot be had.
        """
        tokens = seq.token_ids
        match = None
        matched: list[int] = []
        cached = partial = 0
        if self.cache is not None and not (seq.index == 0 and seq.request.needs_prompt_logprobs):
            # a prompt-logprobs request computes its whole prompt (it still fills the cache)
            match = self.cache.match_prefix(
                tokens[:-1], namespace=seq.request.namespace, lock=True
            )
            matched = list(match.matched_kv_blocks)
            cached, partial = match.match_length, match.partial_tokens
        num_new = min(len(tokens) - cached - partial, max_new_tokens)
        need = self.blocks_for(cached + partial + num_new) - len(matched)
        ids = self.pool.allocate(need, evict_from=self.cache)
        if ids is None:
            if match is not None and match.lock is not None:
                self.cache.unlock(match)  # type: ignore[union-attr]
            return None
        if partial:
            # ids[0] covers the block after the match; the source stays locked by the match.
            self._copy_rows(match.partial_block_id, ids[0], partial)  # type: ignore[union-attr, arg-type]
        seq.block_table = matched + ids
        seq.num_indexed_blocks = len(matched)
        seq.cache_handle = match if match is not None and match.lock is not None else None
        seq.num_computed_tokens = cached + partial
        return num_new

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the table cover ``num_tokens`` tokens; ``False`` (nothing taken) if it cannot."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        ids = self.pool.allocate(need, evict_from=self.cache)
        if ids is None:
            return False
        seq.block_table.extend(ids)
        return True

    def commit(self, seq: Sequence) -> None:
        """Insert the sequence's newly filled (computed) blocks into the index, locked.

        Where the index already held an equal block under another id, the table switches to
        the cached id and the duplicate goes back to the pool now.
        """
        if self.cache is None:
            return
        k = seq.num_computed_tokens // self.block_size
        if k <= seq.num_indexed_blocks:
            return
        table = seq.block_table
        node = self.cache.insert_prefix(
            seq.token_ids[: k * self.block_size],
            table[:k],
            namespace=seq.request.namespace,
            lock=True,
        )
        duplicates = []
        for i, cached_id in enumerate(node.kv_block_ids):
            if table[i] != cached_id:
                duplicates.append(table[i])
                table[i] = cached_id
        old = seq.cache_handle
        seq.cache_handle = node if node.lock is not None else None
        # normally k; fewer only if a (verified) hash collision stopped the insert early: the
        # blocks past it stay private to the sequence and are freed on release
        seq.num_indexed_blocks = len(node.kv_block_ids)
        if old is not None:
            self.cache.unlock(old)
        self.pool.free(duplicates)

    def release(self, seq: Sequence) -> None:
        """Drop everything the sequence holds: unlock indexed blocks, free private ones."""
        if seq.cache_handle is not None and self.cache is not None:
            self.cache.unlock(seq.cache_handle)
        self.pool.free(seq.block_table[seq.num_indexed_blocks :])
        seq.cache_handle = None
        seq.block_table = []
        seq.num_indexed_blocks = 0
        seq.num_computed_tokens = 0

    def require_cache(self) -> PrefixCache:
        """The prefix index; ``ValueError`` with prefix caching off."""
        if self.cache is None:
            raise ValueError("prefix caching is disabled (enable_prefix_caching=False)")
        return self.cache

    def is_cached(self, token_ids: list[int], namespace: Hashable | None) -> bool:
        """Whether every full block of ``token_ids`` is cached (counts as an index query)."""
        cache = self.require_cache()
        full = len(token_ids) // self.block_size * self.block_size
        return cache.match_prefix(token_ids, namespace=namespace).match_length >= full

    def pin(self, token_ids: list[int], namespace: Hashable | None, description: str | None) -> PinnedPrefix:
        """Pin the cached full blocks of ``token_ids``; :class:`PinError` says why not."""
        return self.require_cache().pin(token_ids, namespace=namespace, description=description)

    def unpin(self, token_ids: list[int], namespace: Hashable | None) -> bool:
        """Unpin a pinned prefix; ``False`` if it was not pinned."""
        return bool(self.require_cache().unpin_prefix(token_ids, namespace=namespace))

    def reset_cache(self) -> int:
        """Drop every unlocked cached block back into the pool; returns how many."""
        if self.cache is None:
            return 0
        freed = self.cache.reset()
        self.pool.free(freed)
        return len(freed)
