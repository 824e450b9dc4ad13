"""PrefixIndex: the one driver of a prefix forest (radix tree or hash table).

The forest (:mod:`prefixkv.cache.forest`) knows its shape: walk, cut, add, drop a tail. This
class owns everything around it: the index lock, recency and the policy's hooks, lock and pin
counts and the evictable-leaf heap (:mod:`prefixkv.cache.protection`), the eviction loop
(:mod:`prefixkv.cache.eviction`), the pin registry (:mod:`prefixkv.cache.pins`), which block
ids are held (:mod:`prefixkv.cache.held_ids`) and the statistics. It implements the
:class:`~prefixkv.cache.protocol.PrefixCache` contract.

Thread safety: every public method takes ``self._lock`` (one re-entrant lock per index).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from time import perf_counter_ns
from typing import Generic, cast

from prefixkv.cache._checks import check_count, check_positive_int
from prefixkv.cache.eviction import Evictor
from prefixkv.cache.forest import E, Entry, ExtraKeys, Forest
from prefixkv.cache.held_ids import BlockIds, HeldIds
from prefixkv.cache.pins import PinRegistry, pin_key
from prefixkv.cache.policies import EvictionPolicy, make_policy
from prefixkv.cache.protection import Protection, path_up
from prefixkv.cache.quotas import TenantBlocks, TenantUsage, tenant_usage
from prefixkv.cache.protocol import (
    CacheStats,
    LockHandle,
    Namespace,
    PinError,
    PinnedPrefix,
    PrefixMatch,
    PrefixNode,
)
from prefixkv.cache.retention import Retention
from prefixkv.cache.stats import Counters


class PrefixIndex(Generic[E]):
    """A prefix index over one forest. See :class:`~prefixkv.cache.protocol.PrefixCache`.

    Args:
        forest: the structure (a :class:`~prefixkv.cache.radix.RadixForest` or
            :class:`~prefixkv.cache.hashed.HashForest`), empty and owned by this index.
        max_blocks: size of the block-id space ``[0, max_blocks)`` (the KV pool size).
        block_size: tokens per block (the forest's).
        eviction_policy: ``"lru"`` (default), ``"lfu"``, ``"fifo"``, ... or an ``EvictionPolicy``.
        max_pinned_blocks: pinned-block budget (default 20% of ``max_blocks``).
        clock: time source for recency and retention expiries (injectable for tests).
        max_blocks_per_tenant: a namespace's quota: its cached blocks beyond it are evicted
            first, and it retains at most this many (:meth:`retain`); ``None``: no quota.
    """

    def __init__(
        self,
        forest: Forest[E],
        max_blocks: int,
        block_size: int,
        *,
        eviction_policy: str | EvictionPolicy = "lru",
        max_pinned_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_blocks_per_tenant: int | None = None,
    ) -> None:
        self._max_blocks = check_positive_int(max_blocks, "max_blocks")
        self._quota = (None if max_blocks_per_tenant is None
                       else check_count(max_blocks_per_tenant, "max_blocks_per_tenant"))
        self._ids = HeldIds(max_blocks)  # ValueError past 2**32 ids (uint32)
        self._bs = check_positive_int(block_size, "block_size")
        if max_pinned_blocks is None:
            max_pinned_blocks = max_blocks // 5
        budget = check_count(max_pinned_blocks, "max_pinned_blocks")
        if not callable(clock):
            raise ValueError("clock must be a callable returning a float")  # noqa: TRY004
        self._forest = forest
        forest.share = self._ids.share
        self._policy = make_policy(eviction_policy)
        self._has_evict_hook = type(self._policy).on_evict is not EvictionPolicy.on_evict
        self._clock = clock
        self._lock = threading.RLock()
        self._prot = Protection(self._policy, clock)
        self._evictor = Evictor(self._prot.heap, self._policy, drop_tail=forest.drop_tail,
                                release=self._ids.release,
                                release_owner=self._ids.release_owner,
                                key_at=(self._policy.direct_key_at_depth()
                                        or partial(forest.key_at, self._policy)),
                                refresh=self._prot.refresh,
                                gone=self._policy.on_evict if self._has_evict_hook else None,
                                whole=forest.whole_leaves(self._prot.heap, self._ids, self._policy),
                                retained=self._prot.retained)
        self._counters = Counters()
        self._pins: PinRegistry[E] = PinRegistry(self._prot, budget)
        self.last_pin_error: str | None = None
        self._tenants = None if self._quota is None else TenantBlocks(max_blocks, self._quota)

    # ----------------------------------------------------------------- properties
    @property
    def max_pinned_blocks(self) -> int:
        """The pinned-block budget."""
        return self._pins.budget

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._bs

    @property
    def max_blocks(self) -> int:
        """Size of the block-id space ``[0, max_blocks)``."""
        return self._max_blocks

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy in use."""
        return self._policy

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the index holds."""
        return self._ids.count

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks that ``evict`` could free now (cached, unlocked, unpinned)."""
        return self._ids.count - self._prot.protected_blocks

    def is_cached(self, block_id: int) -> bool:
        """Whether the index holds ``block_id``."""
        return block_id in self._ids

    # ------------------------------------------------------------- entry helpers
    def _cut(self, entry: E, k: int) -> E:
        """The forest's cut; ``entry`` (now the lower part) is re-filed if it is in the heap."""
        upper = self._forest.cut(entry, k)
        if upper is not entry and entry.in_heap:
            self._prot.heap.push(entry)
        return upper

    def _take_lock(self, target: E | None, num_blocks: int) -> LockHandle:
        if target is not None:
            self._prot.add_lock(target, +1)
        return LockHandle(target=target, num_blocks=num_blocks)

    # ------------------------------------------------------------------ protocol
    def match_prefix(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        extra_keys: ExtraKeys = None,
        lock: bool = False,
    ) -> PrefixMatch:
        """Longest cached block-aligned prefix of ``token_ids`` (see :class:`PrefixCache`)."""
        tokens = self._forest.as_query(token_ids)
        with self._lock:
            t0 = perf_counter_ns()
            w = self._forest.walk(tokens, len(tokens), namespace, extra_keys)
            match_length = len(w.ids) * self._bs  # the query's values are valid (Forest.walk)
            partial_bid = None
            if w.partial_entry is not None:  # read before a split below moves blocks
                partial_bid = w.partial_entry.blocks[w.partial_index]
            if w.path:
                last = w.path[-1]
                if w.last_used < last.num_blocks:  # recency for the matched part only
                    w.path[-1] = self._cut(last, w.last_used)
                    if w.partial_entry is last:  # it now starts at the first unmatched block
                        w.partial_index -= w.last_used
                    w.last_used = w.path[-1].num_blocks
                self._prot.touch(w.path, self._clock())
            handle = None
            if lock:
                if w.partial_entry is not None:
                    target = self._cut(w.partial_entry, w.partial_index + 1)
                elif w.path:
                    target = self._cut(w.path[-1], w.last_used)
                else:
                    target = None
                handle = self._take_lock(target, len(w.ids) + (1 if w.partial else 0))
            self._counters.record_query(len(tokens), match_length, w.partial,
                                        perf_counter_ns() - t0)
            return PrefixMatch(token_ids if type(token_ids) is list else tokens, match_length,
                               w.ids, w.partial, partial_bid, namespace, handle)

    def unlock(self, ref: PrefixMatch | PrefixNode) -> None:
        """Release a lock taken with ``lock=True``; ``ValueError`` if none or already released."""
        handle = getattr(ref, "lock", None)
        if not isinstance(handle, LockHandle):
            raise ValueError("ref holds no lock (pass lock=True to match_prefix/insert_prefix)")  # noqa: TRY004
        with self._lock:
            if handle.released:
                raise ValueError("lock already released")
            handle.released = True
            if handle.target is not None:
                self._prot.add_lock(cast("Entry", handle.target), -1)

    def insert_prefix(
        self,
        token_ids: Sequence[int],
        kv_block_ids: Sequence[int],
        pin: bool = False,
        *,
        namespace: Namespace = None,
        extra_keys: ExtraKeys = None,
        lock: bool = False,
        description: str | None = None,
        retention: Retention | None = None,
    ) -> PrefixNode:
        """Cache the full blocks of ``token_ids`` (see :class:`PrefixCache` for ownership).

        ``len(kv_block_ids)`` must be ``len(token_ids) // block_size``; ``pin=True`` also pins
        the inserted prefix (with ``description``), ``lock=True`` locks it until ``unlock``;
        ``retention`` retains it (:meth:`retain`; not beyond the namespace's quota, silently).
        """
        tokens = self._forest.as_tokens(token_ids)
        bs = self._bs
        nb = len(tokens) // bs
        if isinstance(kv_block_ids, (str, bytes, bytearray)) or kv_block_ids is None:
            raise ValueError(f"kv_block_ids must be a sequence of ints, got {type(kv_block_ids).__name__}")
        ids = self._ids.pack(kv_block_ids)
        if len(ids) != nb:
            raise ValueError(
                f"kv_block_ids has {len(ids)} ids but token_ids has {len(tokens)} tokens = "
                f"{nb} full blocks of {bs}"
            )
        with self._lock:
            w = self._forest.walk(tokens, nb * bs, namespace, extra_keys)
            returned: list[int] = []
            new: list[BlockIds] = []

            def claim(stop: int) -> tuple[BlockIds, int]:  # the last check: holds ids[m:stop]
                got, taken, owner = self._ids.claim(ids, w.ids, stop)
                returned.extend(got)
                new.append(taken)
                return taken, owner

            now = self._clock()
            added = self._forest.add(tokens, nb, w, namespace, extra_keys, claim, now)
            # --- stored: nothing below fails
            if self._tenants is not None and new:
                self._tenants.stored(namespace, new[0])
            for e in added.refile:
                self._prot.refresh(e)
            self._counters.inserts += 1
            if added.path:
                self._prot.touch(added.path, now)
            target = added.target
            if retention is not None and target is not None:
                self._retain_at(target, retention, namespace, now, strict=False)
            handle = self._take_lock(target, nb) if lock else None
            is_pinned = False
            if pin and nb:
                is_pinned = self.pin_prefix(
                    tokens[: nb * bs], namespace=namespace, description=description,
                    extra_keys=None if extra_keys is None else list(extra_keys)[:nb])
            elif target is not None:
                is_pinned = target.pin_ref > 0
            shown = token_ids if type(token_ids) is list else tokens
            return PrefixNode(
                token_ids=shown[: nb * bs],
                kv_block_ids=added.ids,
                returned_block_ids=returned,
                is_pinned=is_pinned,
                ref_count=target.lock_ref if target is not None else 0,
                last_access_time=now,
                namespace=namespace,
                lock=handle,
            )

    def evict(self, num_blocks: int) -> BlockIds:
        """Evict up to ``num_blocks`` blocks, leaves first, in policy order; caller owns the ids
        (an ``array('I')``, deepest block of each leaf first).

        Order and cost: :class:`prefixkv.cache.eviction.Evictor` (a leaf's whole run of tail
        blocks per step for ``depth_monotone_keys`` policies).
        """
        check_count(num_blocks, "num_blocks")
        with self._lock:
            self._prot.retained.expire()
            if self._tenants is not None:  # over-quota tenants' blocks first
                return self._tenants.evict(num_blocks, self._evictor, self._forest.entries,
                                           self._counters)
            try:
                out = self._evictor.evict(num_blocks)
            finally:
                self._counters.evictions += self._evictor.entries_freed
            self._counters.evicted_blocks += len(out)
            return out

    def tenants(self) -> dict[Namespace, TenantUsage]:
        """Cached and retained blocks per namespace holding any (cached ones counted only with
        a quota)."""
        with self._lock:
            self._prot.retained.expire()
            return tenant_usage(self._tenants, self._prot.retained.by_tenant)

    def evict_lru(self, num_blocks: int) -> BlockIds:
        """Seed 004's name for :meth:`evict`."""
        return self.evict(num_blocks)

    # ----------------------------------------------------------------- retention
    def retain(self, token_ids: Sequence[int], retention: Retention, *,
               namespace: Namespace = None, extra_keys: ExtraKeys = None) -> int:
        """Soft-retain the cached full blocks of a prefix (see :class:`PrefixCache`); returns
        how many blocks it covers (0: none cached)."""
        if not isinstance(retention, Retention):
            raise ValueError(f"retention must be a Retention, got {type(retention).__name__}")  # noqa: TRY004
        tokens = self._forest.as_tokens(token_ids)
        with self._lock:
            w = self._forest.walk(tokens, len(tokens) // self._bs * self._bs, namespace,
                                  extra_keys)
            if not w.path:
                return 0
            target = self._cut(w.path[-1], w.last_used)
            self._retain_at(target, retention, namespace, self._clock(), strict=True)
            return len(w.ids)

    def _retain_at(self, target: E, retention: Retention, namespace: Namespace, now: float,
                   *, strict: bool) -> None:
        if not self._prot.retained.ask(path_up(target), retention, namespace, now,
                                       self._quota, strict=strict):
            self._counters.retentions_refused += 1

    # ---------------------------------------------------------------------- pins
    def pin(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        description: str | None = None,
        extra_keys: ExtraKeys = None,
    ) -> PinnedPrefix:
        """Pin the full blocks of a cached prefix; raises :class:`PinError` with the reason."""
        tokens = self._forest.as_tokens(token_ids)
        nb = len(tokens) // self._bs
        if nb == 0:
            raise PinError(f"prefix of {len(tokens)} tokens is shorter than one block ({self._bs})")
        with self._lock:
            w = self._forest.walk(tokens, nb * self._bs, namespace, extra_keys)
            key = pin_key(namespace, extra_keys, tokens, nb, self._bs)
            known = self._pins.get(key)
            if known is not None:
                return known
            if len(w.ids) < nb:
                raise PinError(f"prefix not cached: {len(w.ids)} of its {nb} blocks are cached")
            target = self._cut(w.path[-1], w.last_used)
            return self._pins.pin(key, target, nb, description, self._clock())

    def pin_prefix(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        description: str | None = None,
        extra_keys: ExtraKeys = None,
    ) -> bool:
        """Seed 004's pin: ``True`` on success, else ``False`` with ``last_pin_error`` set."""
        try:
            self.pin(token_ids, namespace=namespace, description=description,
                     extra_keys=extra_keys)
        except PinError as exc:
            self.last_pin_error = str(exc)
            return False
        self.last_pin_error = None
        return True

    def unpin_prefix(self, token_ids: Sequence[int], *, namespace: Namespace = None,
                     extra_keys: ExtraKeys = None) -> bool:
        """Unpin a pinned prefix; ``False`` if that prefix was not pinned."""
        tokens = self._forest.as_tokens(token_ids)
        try:
            key = pin_key(namespace, extra_keys, tokens, len(tokens) // self._bs, self._bs)
            hash(key)
        except TypeError:
            raise ValueError("namespace and extra_keys must be hashable") from None
        with self._lock:
            return self._pins.unpin(key)

    def list_pinned(self) -> list[PinnedPrefix]:
        """Pinned prefixes, oldest first."""
        with self._lock:
            return self._pins.records()

    def reset(self) -> BlockIds:
        """Unpin all and evict every unlocked block; returns the freed ids (caller owns them)."""
        with self._lock:
            self._pins.unpin_all()
            return self.evict(self.num_evictable_blocks)

    # --------------------------------------------------------------------- stats
    def get_hit_rate(self) -> float:
        """Queries with a non-empty match over all queries (seed 004)."""
        with self._lock:
            c = self._counters
            return c.hits / c.queries if c.queries else 0.0

    def reset_stats(self) -> None:
        """Zero the query/insert/eviction counters (cached contents are unchanged)."""
        with self._lock:
            self._counters = Counters()

    def get_stats(self) -> CacheStats:
        """Snapshot of counters and sizes."""
        with self._lock:
            self._prot.retained.expire()
            return self._counters.snapshot(
                retained_blocks=self._prot.retained.blocks,
                index=self._forest.name,
                block_size=self._bs,
                max_blocks=self._max_blocks,
                cached_blocks=self._ids.count,
                pinned_blocks=self._prot.pinned_blocks,
                locked_blocks=self._prot.locked_blocks,
                evictable_blocks=self.num_evictable_blocks,
                num_nodes=self._forest.num_entries,
                memory_bytes=self._forest.memory_bytes() + self._ids.memory_bytes(),
                policy=self._policy.name,
            )

    def check_invariants(self) -> None:
        """Assert every structural and accounting invariant (tests and debugging)."""
        with self._lock:
            entries = list(self._forest.check())
            assert self._prot.check(entries) == self._ids.as_set(), "held ids out of sync"
            holders = Counter(e.owner for e in entries if e.owner)
            assert all(self._ids.holders(t) == n for t, n in holders.items()), "owner counts"
            for e in entries:
                assert not e.owner or all(self._ids.owner_of(b) == e.owner for b in e.blocks)
            assert len(entries) == self._forest.num_entries
            if self._tenants is not None:
                self._tenants.check(self._forest.entries)
