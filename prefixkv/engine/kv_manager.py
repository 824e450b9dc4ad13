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

With lower tiers (a :class:`~prefixkv.tiers.TieredStore`), every cached block also has a tier
key (``_keys``: cached block id -> chained key, set when the block enters the index). Blocks
the index evicts are offloaded to the host tier before their ids go back to the pool; newly
indexed blocks are published to the disk/remote tiers; and admission continues the pool's
match with blocks found in the lower tiers: they get fresh pool blocks, their KV is copied in,
and they enter the index exactly as if they had been computed.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING

from prefixkv.cache.block_pool import BlockPool
from prefixkv.cache.protocol import PinnedPrefix, PrefixCache
from prefixkv.cache.retention import RetentionError
from prefixkv.engine.residency import CacheObserver
from prefixkv.engine.sequence import Sequence
from prefixkv.tiers import Put, TieredStore
from prefixkv.tiers.spec import TierSpec, parse_size
from prefixkv.tiers.stats import TierCounters, TierStats

if TYPE_CHECKING:
    from prefixkv.engine.kv_events import KVEventSink
    from prefixkv.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CopyRows = Callable[[int, int, int], None]
"""``copy_rows(src_block, dst_block, num_rows)``: copy the first rows of a KV block."""


class KVManager:
    """Allocates, shares and releases the KV blocks of sequences. Single-threaded (engine loop)."""

    def __init__(
        self, num_blocks: int, block_size: int, cache: PrefixCache | None, copy_rows: CopyRows,
        tiers: TieredStore | None = None, observer: CacheObserver | None = None,
    ) -> None:
        if cache is not None and cache.block_size != block_size:
            raise ValueError(
                f"cache block_size {cache.block_size} != engine block_size {block_size}"
            )
        if tiers is not None and cache is None:
            raise ValueError("lower KV tiers need prefix caching (enable_prefix_caching=True)")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.cache = cache
        self.tiers = tiers
        self._copy_rows = copy_rows
        self._keys: dict[int, bytes] = {}  # cached block id -> tier key (only with tiers)
        self._pooled: set[bytes] = set()  # the values of _keys
        self._prefetched: set[int] = set()  # seq ids whose read-ahead was considered
        self._chains: dict[int, list[bytes]] = {}  # seq_id -> keys of its leading blocks
        self._pinned_keys: dict[tuple[Hashable | None, tuple[int, ...]], list[bytes]] = {}
        self._pool_counters = TierCounters("pool", num_blocks)
        self._events: KVEventSink | None = None
        self.observer = observer if observer is not None else CacheObserver()
        if tiers is not None:
            tiers.observe(self.observer.tier)

    @property
    def events(self) -> KVEventSink | None:
        """The KV events (BlockStored / BlockRemoved) sink, if any; setting it also lets it hear
        the host tier's evictions."""
        return self._events

    @events.setter
    def events(self, sink: KVEventSink | None) -> None:
        self._events = sink
        tiers = self.tiers
        if tiers is not None and tiers.host is not None:
            tiers.host.on_drop = None if sink is None else sink.host_dropped
        if tiers is not None and tiers.disk is not None:
            tiers.disk.on_stored = None if sink is None else sink.disk_stored
            tiers.disk.on_drop = None if sink is None else sink.disk_dropped

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

    def admit(self, seq: Sequence, max_new_tokens: int, *, use_tiers: bool = True) -> int | None:
        """Give a waiting sequence its cached prefix and the blocks for its first chunk.

        Matches ``token_ids[:-1]`` (so at least one token is computed), locks the match, then
        (with lower tiers) looks the following full blocks up there; hits get fresh blocks,
        their KV is loaded and they are indexed like computed blocks. Otherwise the partial
        block's matching rows are copied into a fresh block. Allocates blocks for up to
        ``max_new_tokens`` more tokens. Returns how many tokens to compute this step, or
        ``None`` (and nothing held) when the blocks cannot be had.
        """
        tokens = seq.token_ids
        bs = self.block_size
        match = None
        matched: list[int] = []
        cached = partial = 0
        readable = self._readable(seq)
        computes = readable == 0
        if self.cache is not None and not computes:
            # a prompt-logprobs request computes its prompt from where they start (it still
            # fills the cache)
            match = self.cache.match_prefix(
                tokens[:readable], namespace=seq.request.namespace, lock=True
            )
            matched = list(match.matched_kv_blocks)
            cached, partial = match.match_length, match.partial_tokens
            self._retain(seq, tokens[:cached])
        hits = []
        asked = 0
        if self.tiers is not None and use_tiers and not computes:  # nor from a lower tier
            num_full = readable // bs
            chain = self._chain(seq, num_full) if num_full > len(matched) else []
            if chain:
                hits = self.tiers.lookup(chain[len(matched) : num_full])
                asked = (num_full - len(matched)) * bs
            if seq.seq_id in self._prefetched:  # read ahead no more: admission read its blocks
                self.tiers.cancel_prefetch(seq.seq_id)
            if hits:
                partial = 0  # whole blocks from below supersede the copied rows
        loaded = len(hits) * bs
        num_new = min(len(tokens) - cached - loaded - partial, max_new_tokens)
        need = self.blocks_for(cached + loaded + partial + num_new) - len(matched)
        ids = self._allocate(need)
        if ids is None:
            if self.tiers is not None:
                self.tiers.cancel(hits)
                self._chains.pop(seq.seq_id, None)
            if match is not None and match.lock is not None:
                self.cache.unlock(match)  # type: ignore[union-attr]
            # loaded blocks all need room now; a chunked prefill may still fit without them
            return self.admit(seq, max_new_tokens, use_tiers=False) if hits else None
        if hits:
            try:
                self.tiers.load(hits, ids[: len(hits)])  # type: ignore[union-attr]
            except Exception:  # a lower tier is a cache: recompute instead of failing
                logger.warning("loading %d blocks from lower tiers failed; recomputing",
                               len(hits), exc_info=True)
                self.tiers.cancel(hits)  # type: ignore[union-attr]
                self.pool.free(ids)
                if match is not None and match.lock is not None:
                    self.cache.unlock(match)  # type: ignore[union-attr]
                return self.admit(seq, max_new_tokens, use_tiers=False)
        elif partial:
            # ids[0] covers the block after the match; the source stays locked by the match.
            self._copy_rows(match.partial_block_id, ids[0], partial)  # type: ignore[union-attr, arg-type]
        seq.block_table = matched + ids
        seq.num_indexed_blocks = len(matched)
        seq.cache_handle = match if match is not None and match.lock is not None else None
        seq.num_computed_tokens = cached + loaded + partial
        seq.tier_tokens = (asked, loaded)
        seq.tier_loaded = tuple((t, bs * sum(h.tier == t for h in hits)) for t in {h.tier for h in hits})
        self.observer.admitted(seq, matched, readable, cached + loaded + partial)
        if matched:
            self._pool_counters.add_load(len(matched), cached, 0, 0.0)
        if hits:
            self.commit(seq)  # loaded blocks enter the index (locked) like computed ones
        return num_new

    def prefetch(self, seq: Sequence) -> bool:
        """Start reading the blocks of a queued sequence's prompt that only the disk or remote
        tier holds into host staging, off the engine thread (the leading blocks the pool or
        the host tier holds are skipped); ``True`` if a read was started. Admission then takes
        the staged blocks (``TieredStore.lookup``); nothing is held for the sequence meanwhile."""
        tiers = self.tiers
        if tiers is None or tiers.prefetcher is None or seq.seq_id in self._prefetched:
            return False
        self._prefetched.add(seq.seq_id)
        if seq.index > 0 or seq.request.computes_prompt:  # shares / computes its prompt
            return False
        chain = self._chain(seq, self._readable(seq) // self.block_size)
        host = tiers.host
        j = 0
        while j < len(chain) and (chain[j] in self._pooled or (host is not None and chain[j] in host)):
            j += 1
        return j < len(chain) and tiers.prefetch(seq.seq_id, chain[j:])

    @staticmethod
    def _readable(seq: Sequence) -> int:
        """How many leading tokens of ``seq`` may be read from the cache or a lower tier: all
        but the last (always computed), within its request's :attr:`~Request.read_limit`
        (sample 0's; the others share the prompt sample 0 computed)."""
        limit = seq.request.read_limit if seq.index == 0 else None
        n = len(seq.token_ids) - 1
        return n if limit is None else min(n, limit)

    def _allocate(self, n: int) -> list[int] | None:
        """``n`` pool blocks, evicting unlocked cached blocks when short (offloading them to
        the host tier first); ``None`` (nothing taken, nothing evicted) if they cannot be had."""
        short = n - self.pool.num_free
        if short > 0:
            if self.cache is None or self.cache.num_evictable_blocks < short:
                return None
            freed = self.cache.evict(short)
            self.observer.evicted(freed)
            kept: list[tuple[int, bytes]] = []
            if self.tiers is not None:
                pairs = [(b, self._keys.pop(b)) for b in freed if b in self._keys]
                self._pooled.difference_update(k for _, k in pairs)
                kept = self.tiers.offload(pairs)
            if self.events is not None:
                self.events.removed(freed, kept)
            self.pool.free(freed)
        return self.pool.allocate(n)

    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Tier keys of ``seq``'s first ``num_blocks`` blocks (cached on the sequence's id)."""
        assert self.tiers is not None
        chain = self._chains.setdefault(seq.seq_id, [])
        if len(chain) < num_blocks:
            try:
                self.tiers.keyer.extend(chain, seq.token_ids, num_blocks, seq.request.namespace)
            except ValueError:  # a namespace with no stable serialisation: pool only
                return []
        return chain

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the table cover ``num_tokens`` tokens; ``False`` (nothing taken) if it cannot."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        ids = self._allocate(need)
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
            retention=seq.request.params.retention,
        )
        duplicates = []
        for i, cached_id in enumerate(node.kv_block_ids):
            if table[i] != cached_id:
                duplicates.append(table[i])
                table[i] = cached_id
        old = seq.cache_handle
        seq.cache_handle = node if node.lock is not None else None
        first = seq.num_indexed_blocks
        # normally k; fewer only if a (verified) hash collision stopped the insert early: the
        # blocks past it stay private to the sequence and are freed on release
        seq.num_indexed_blocks = len(node.kv_block_ids)
        self.observer.stored(table[first : seq.num_indexed_blocks])
        pairs: list[tuple[int, bytes]] = []
        chain: list[bytes] = []
        if self.tiers is not None and seq.num_indexed_blocks > first:
            chain = self._chain(seq, seq.num_indexed_blocks)
            if chain:
                pairs = [(table[i], chain[i]) for i in range(first, seq.num_indexed_blocks)]
                self._keys.update(pairs)
                self._pooled.update(k for _, k in pairs)
        if self.events is not None and seq.num_indexed_blocks > first:
            # before the tiers see the blocks: the sink must know their keys when the disk
            # tier's writer reports them written
            self.events.stored(table[first : seq.num_indexed_blocks],
                               table[first - 1] if first else None,
                               seq.token_ids[first * self.block_size : seq.num_indexed_blocks
                                             * self.block_size], seq.request.namespace,
                               [k for _, k in pairs])
        if pairs and self.tiers is not None:  # (their tenant and retention go down with them)
            self.tiers.publish(pairs, chain[: seq.num_indexed_blocks],
                               Put(seq.request.namespace, seq.request.params.retention))
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
        self._chains.pop(seq.seq_id, None)
        if seq.seq_id in self._prefetched and self.tiers is not None:
            self._prefetched.discard(seq.seq_id)
            self.tiers.cancel_prefetch(seq.seq_id)

    def _retain(self, seq: Sequence, tokens: list[int]) -> None:
        """Retain a request's cached prefix as it asked (none beyond its tenant's quota)."""
        retention = seq.request.params.retention
        if retention is not None and tokens and self.cache is not None:
            with suppress(RetentionError):
                self.cache.retain(tokens, retention, namespace=seq.request.namespace)

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

    def lookup(self, token_ids: list[int], namespace: Hashable | None) -> dict[str, int]:
        """Where a request for ``token_ids`` would read its cached prefix from, in tokens (all
        but the last, which a request always computes): ``pool`` (the index's match, partial
        rows included), then per lower tier the whole
        blocks after it that tier would supply (host, disk, remote: the first holding each,
        up to the first block none holds), and ``reusable``, their sum. Nothing is read or
        moved; the pool's match counts as a query and refreshes the matched prefix's recency,
        as a request's match does. ``ValueError`` with caching off."""
        readable = token_ids[:-1]
        match = self.require_cache().match_prefix(readable, namespace=namespace)
        bs = self.block_size
        full = match.match_length
        out = {"pool": full + match.partial_tokens}
        if self.tiers is not None:
            chain = self.tiers.keyer.extend([], readable, len(readable) // bs, namespace)
            found = self.tiers.sources(chain[full // bs :])
            for name in self.tiers.names():
                out[name] = found.count(name) * bs
            if found:  # whole blocks from below supersede the copied rows, as in admit
                out["pool"] = full
        out["reusable"] = sum(out.values())
        return out

    def pin(self, token_ids: list[int], namespace: Hashable | None, description: str | None) -> PinnedPrefix:
        """Pin the cached full blocks of ``token_ids``; :class:`PinError` says why not. With
        lower tiers their keys are pinned there too (never evicted from the host or disk; on the
        remote server stored without an expiry, see :class:`~prefixkv.tiers.remote.RemoteTier`)."""
        pinned = self.require_cache().pin(token_ids, namespace=namespace, description=description)
        key = (namespace, tuple(pinned.token_ids))
        if self.tiers is not None and key not in self._pinned_keys:
            try:
                keys = self.tiers.keyer.extend([], pinned.token_ids, pinned.num_blocks, namespace)
            except ValueError:  # a namespace with no stable serialisation: pool only
                keys = []
            self._pinned_keys[key] = keys
            ids = self.require_cache().match_prefix(pinned.token_ids, namespace=namespace)
            self.tiers.pin(keys, list(ids.matched_kv_blocks)[: len(keys)])
        return pinned

    def unpin(self, token_ids: list[int], namespace: Hashable | None) -> bool:
        """Unpin a pinned prefix (in every tier); ``False`` if it was not pinned."""
        ok = bool(self.require_cache().unpin_prefix(token_ids, namespace=namespace))
        full = len(token_ids) // self.block_size * self.block_size
        keys = self._pinned_keys.pop((namespace, tuple(token_ids[:full])), None)
        if ok and keys and self.tiers is not None:
            self.tiers.unpin(keys)
        return ok

    def reset_cache(self, tiers: Iterable[str] = ("host",)) -> dict[str, int | None]:
        """Unpin everything (in every tier), drop every unlocked cached block back into the
        pool, and clear the configured lower tiers named in ``tiers`` (see
        :func:`~prefixkv.tiers.spec.reset_tiers`). Per tier, how many blocks were dropped:
        ``pool`` first (``None``: the remote could not be reached)."""
        out: dict[str, int | None] = {"pool": 0}
        if self.cache is None:
            return out
        freed = self.cache.reset()
        if self.events is not None:
            self.events.reset(freed, self.cache.num_cached_blocks)
        for b in freed:
            self._pooled.discard(self._keys.pop(b, b""))
        if self.tiers is not None:
            for keys in self._pinned_keys.values():
                self.tiers.unpin(keys)
        self._pinned_keys.clear()
        if self.tiers is not None:
            self.tiers.pinned.clear()
            self.tiers.retained.clear()
            out.update(self.tiers.clear(tiers))
        self.pool.free(freed)
        out["pool"] = len(freed)
        return out

    def spill(self, num_blocks: int | None = None) -> int:
        """Evict up to ``num_blocks`` (default: all) unlocked, unpinned cached blocks from the
        pool, through the normal eviction path (so they move to the host tier if there is
        one); returns how many went back to the free list."""
        if self.cache is None:
            return 0
        before = self.cache.num_cached_blocks
        n = self.cache.num_evictable_blocks if num_blocks is None else num_blocks
        ids = self._allocate(self.pool.num_free + min(n, self.cache.num_evictable_blocks))
        if ids is not None:
            self.pool.free(ids)
        return before - self.cache.num_cached_blocks

    def tier_stats(self) -> list[TierStats] | None:
        """Per-tier counters, the pool first (``None`` without lower tiers)."""
        if self.tiers is None:
            return None
        cached = self.cache.num_cached_blocks if self.cache is not None else 0
        return [self._pool_counters.snapshot(cached), *self.tiers.stats()]


def make_tier_store(spec: TierSpec, runner: ModelRunner, quota: int | None) -> TieredStore | None:
    """The lower tiers ``spec`` asks for over ``runner``'s KV pool (``None`` if none)."""
    if not spec.enabled:
        return None
    from prefixkv.runner.kv_transfer import KVTransfer

    probe = KVTransfer(runner.kv_pool, 0)
    host_blocks = parse_size(spec.offload_size, probe.block_nbytes, "kv_offload_size")
    transfer = KVTransfer(runner.kv_pool, host_blocks)
    return TieredStore.create(spec, transfer, runner.fingerprint, runner.block_size,
                              host_blocks, quota)
