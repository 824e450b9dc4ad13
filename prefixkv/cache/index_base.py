"""What the radix and the hashed index share: the protocol's methods over *entries*.

An *entry* is a radix node (many blocks) or a hashed block (one block). Entries form a forest:
each has a ``parent`` (``None`` or a root sentinel at the top). A subclass knows how to walk a
query (``_walk``), cut an entry at a block boundary (``_cut``), drop an evictable leaf's tail
blocks (``_drop_tail``) and insert (``_insert``); everything else lives here: match with
recency and locking, unlock, evict, the pin registry and its budget, reset, statistics.
Path-wide lock/pin counts and the evictable-leaf heap are in :mod:`prefixkv.cache.protection`;
the eviction order in :mod:`prefixkv.cache.eviction`; which block ids the index holds, in
:mod:`prefixkv.cache.held_ids`.

Thread safety: every public method takes ``self._lock`` (one re-entrant lock per index).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

from prefixkv.cache._checks import (
    as_token_list,
    check_count,
    check_positive_int,
    check_tokens,
)
from prefixkv.cache.eviction import Evictor, key_at_depth
from prefixkv.cache.held_ids import HeldIds
from prefixkv.cache.policies import EvictionPolicy, make_policy
from prefixkv.cache.protection import Protection, is_evictable_leaf
from prefixkv.cache.protocol import (
    CacheStats,
    LockHandle,
    Namespace,
    PinError,
    PinnedPrefix,
    PrefixMatch,
    PrefixNode,
)
from prefixkv.cache.stats import Counters


@dataclass(slots=True)
class Walk:
    """A read-only walk of the index along a query (what ``match_prefix`` found).

    ``path`` holds the entries the match went through, the last one possibly only for its
    first ``last_used`` blocks. ``partial_entry``/``partial_index`` locate the block whose
    leading ``partial`` tokens equal the query's next tokens.
    """

    ids: list[int]
    path: list[Any]
    last_used: int
    partial: int = 0
    partial_entry: Any = None
    partial_index: int = 0


class PrefixIndexBase:
    """Shared machinery; subclasses implement ``_walk``, ``_cut``, ``_drop_tail``, ``insert``."""

    index_name = "base"

    def __init__(
        self,
        max_blocks: int,
        block_size: int,
        *,
        eviction_policy: str | EvictionPolicy = "lru",
        max_pinned_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_blocks = check_positive_int(max_blocks, "max_blocks")
        self._bs = check_positive_int(block_size, "block_size")
        if max_pinned_blocks is None:
            max_pinned_blocks = max_blocks // 5
        self.max_pinned_blocks = check_count(max_pinned_blocks, "max_pinned_blocks")
        if not callable(clock):
            raise ValueError("clock must be a callable returning a float")  # noqa: TRY004
        self._policy = make_policy(eviction_policy)
        hooks = type(self._policy)
        self._has_access_hook = hooks.on_access is not EvictionPolicy.on_access
        self._has_evict_hook = hooks.on_evict is not EvictionPolicy.on_evict
        self._clock = clock
        self._lock = threading.RLock()
        self._prot = Protection(self._policy)
        self._evictor = Evictor(self._prot.heap, self._policy, drop_tail=self._drop_tail,
                                key_at=self._key_at, refresh=self._prot.refresh,
                                gone=self._gone)
        self._counters = Counters()
        self._pins: dict[tuple[Namespace, tuple[int, ...]], tuple[PinnedPrefix, Any]] = {}
        self._ids = HeldIds(max_blocks)
        self._num_entries = 0
        self._tick = 0
        self.last_pin_error: str | None = None

    # ----------------------------------------------------------------- properties
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

    # ------------------------------------------------------------ subclass hooks
    def _walk(self, tokens: Sequence[int], n: int, namespace: Namespace, extra: Any) -> Walk:
        raise TypeError("subclass must implement _walk")

    def _cut(self, entry: Any, k: int) -> Any:
        """Return an entry on ``entry``'s path that ends exactly after its ``k``-th block."""
        raise TypeError("subclass must implement _cut")

    def _drop_tail(self, entry: Any, k: int) -> list[int]:
        """Remove the last ``k`` blocks of an evictable leaf; detach it when empty."""
        raise TypeError("subclass must implement _drop_tail")

    def _memory_bytes(self) -> int:
        raise TypeError("subclass must implement _memory_bytes")

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
        """Insert ``nb`` full blocks (``ids`` already length-checked); takes ``self._lock``."""
        raise TypeError("subclass must implement _insert")

    def _as_tokens(self, token_ids: Any) -> Sequence[int]:
        """The index's working form of a query (a list, or an array kept as is)."""
        return as_token_list(token_ids)

    # ------------------------------------------------------------- entry helpers
    def _touch(self, entries: Sequence[Any], now: float) -> None:
        self._tick += 1
        tick = self._tick
        for e in entries:
            e.last_access_time = now
            e.access_count += 1
            e.tick = tick
        if self._has_access_hook:
            for e in entries:
                self._policy.on_access(e)
        # Only the last entry of a path can be a leaf. A new leaf joins the heap here; one
        # already in it is re-filed, unless keys are monotone: then its stored key stays a valid
        # lower bound and the heap refreshes it lazily.
        if entries:
            last = entries[-1]
            if last.in_heap:
                if not self._policy.monotone_keys:
                    self._prot.refresh(last)
            elif is_evictable_leaf(last):
                self._prot.refresh(last)

    def _take_lock(self, target: Any, num_blocks: int) -> LockHandle:
        if target is not None:
            self._prot.add_lock(target, +1)
        return LockHandle(target=target, num_blocks=num_blocks)

    # ------------------------------------------------------------------ protocol
    def match_prefix(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        extra_keys: Sequence[Hashable | None] | None = None,
        lock: bool = False,
    ) -> PrefixMatch:
        """Longest cached block-aligned prefix of ``token_ids`` (see :class:`PrefixCache`)."""
        tokens = self._as_tokens(token_ids)
        with self._lock:
            t0 = perf_counter_ns()
            w = self._walk(tokens, len(tokens), namespace, extra_keys)
            match_length = len(w.ids) * self._bs
            # matched tokens equal cached (validated) keys; check the rest before any change
            check_tokens(tokens[match_length:])
            partial_bid = None
            if w.partial:  # read before any split below moves blocks between nodes
                partial_bid = w.partial_entry.blocks[w.partial_index]
            if w.path:
                last = w.path[-1]
                if w.last_used < last.num_blocks:  # recency for the matched part only
                    w.path[-1] = self._cut(last, w.last_used)
                    if w.partial_entry is last:  # it now starts at the first unmatched block
                        w.partial_index -= w.last_used
                    w.last_used = w.path[-1].num_blocks
                self._touch(w.path, self._clock())
            handle = None
            if lock:
                if w.partial:
                    target = self._cut(w.partial_entry, w.partial_index + 1)
                elif w.path:
                    target = self._cut(w.path[-1], w.last_used)
                else:
                    target = None
                handle = self._take_lock(target, len(w.ids) + (1 if w.partial else 0))
            self._counters.record_query(len(tokens), match_length, w.partial,
                                        perf_counter_ns() - t0)
            return PrefixMatch(
                token_ids=token_ids if type(token_ids) is list else tokens,
                match_length=match_length,
                matched_kv_blocks=w.ids,
                partial_tokens=w.partial,
                partial_block_id=partial_bid,
                namespace=namespace,
                lock=handle,
            )

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
                self._prot.add_lock(handle.target, -1)

    def insert_prefix(
        self,
        token_ids: Sequence[int],
        kv_block_ids: Sequence[int],
        pin: bool = False,
        *,
        namespace: Namespace = None,
        extra_keys: Sequence[Hashable | None] | None = None,
        lock: bool = False,
        description: str | None = None,
    ) -> PrefixNode:
        """Cache the full blocks of ``token_ids`` (see :class:`PrefixCache` for ownership).

        ``len(kv_block_ids)`` must be ``len(token_ids) // block_size``; ``pin=True`` also pins
        the inserted prefix (with ``description``), ``lock=True`` locks it until ``unlock``.
        """
        tokens, nb = self._aligned(token_ids)
        ids = kv_block_ids if isinstance(kv_block_ids, list) else list(kv_block_ids)
        if len(ids) != nb:
            raise ValueError(
                f"kv_block_ids has {len(ids)} ids but token_ids has {len(tokens)} tokens = "
                f"{nb} full blocks of {self._bs}"
            )
        shown = token_ids if type(token_ids) is list else tokens
        return self._insert(tokens, nb, ids, pin, namespace, extra_keys, lock, description, shown)

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` blocks, leaves first, in policy order; caller owns the ids.

        Order and cost: :class:`prefixkv.cache.eviction.Evictor` (a leaf's whole run of tail
        blocks per step for ``depth_monotone_keys`` policies).
        """
        check_count(num_blocks, "num_blocks")
        with self._lock:
            out = self._evictor.evict(num_blocks)
            self._counters.evicted_blocks += len(out)
            return out

    def _gone(self, entry: Any) -> None:
        """``entry`` left the index (all its blocks evicted)."""
        self._counters.evictions += 1
        if self._has_evict_hook:
            self._policy.on_evict(entry)

    def _key_at(self, entry: Any, depth: int) -> Any:
        """The policy's key for ``entry`` as if its blocks below ``depth`` were gone."""
        return key_at_depth(self._policy, entry, depth)

    def evict_lru(self, num_blocks: int) -> list[int]:
        """Seed 004's name for :meth:`evict`."""
        return self.evict(num_blocks)

    def _aligned(self, token_ids: Sequence[int]) -> tuple[Sequence[int], int]:
        tokens = self._as_tokens(token_ids)
        nb = len(tokens) // self._bs
        return tokens, nb

    def pin(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        description: str | None = None,
        extra_keys: Sequence[Hashable | None] | None = None,
    ) -> PinnedPrefix:
        """Pin the full blocks of a cached prefix; raises :class:`PinError` with the reason."""
        tokens, nb = self._aligned(token_ids)
        if nb == 0:
            raise PinError(f"prefix of {len(tokens)} tokens is shorter than one block ({self._bs})")
        with self._lock:
            key = (namespace, tuple(tokens[: nb * self._bs]))
            if key in self._pins:
                return self._pins[key][0]
            w = self._walk(tokens, nb * self._bs, namespace, extra_keys)
            if len(w.ids) < nb:
                raise PinError(f"prefix not cached: {len(w.ids)} of its {nb} blocks are cached")
            target = self._cut(w.path[-1], w.last_used)
            new = self._prot.new_pinned_blocks(target)
            pinned = self._prot.pinned_blocks
            if pinned + new > self.max_pinned_blocks:
                raise PinError(
                    f"pinning {new} more blocks would exceed max_pinned_blocks="
                    f"{self.max_pinned_blocks} ({pinned} pinned)"
                )
            self._prot.add_pin(target, +1)
            info = PinnedPrefix(
                token_ids=list(key[1]),
                num_blocks=nb,
                namespace=namespace,
                description=description,
                pinned_at=self._clock(),
            )
            self._pins[key] = (info, target)
            return info

    def pin_prefix(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        description: str | None = None,
    ) -> bool:
        """Seed 004's pin: ``True`` on success, else ``False`` with ``last_pin_error`` set."""
        try:
            self.pin(token_ids, namespace=namespace, description=description)
        except PinError as exc:
            self.last_pin_error = str(exc)
            return False
        self.last_pin_error = None
        return True

    def unpin_prefix(self, token_ids: Sequence[int], *, namespace: Namespace = None) -> bool:
        """Unpin a pinned prefix; ``False`` if that prefix was not pinned."""
        tokens, nb = self._aligned(token_ids)
        with self._lock:
            entry = self._pins.pop((namespace, tuple(tokens[: nb * self._bs])), None)
            if entry is None:
                return False
            self._prot.add_pin(entry[1], -1)
            return True

    def list_pinned(self) -> list[PinnedPrefix]:
        """Pinned prefixes, oldest first."""
        with self._lock:
            return [info for info, _ in self._pins.values()]

    def reset(self) -> list[int]:
        """Unpin all and evict every unlocked block; returns the freed ids (caller owns them)."""
        with self._lock:
            for _, target in self._pins.values():
                self._prot.add_pin(target, -1)
            self._pins.clear()
            return self.evict(self.num_evictable_blocks)

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
            return self._counters.snapshot(
                index=self.index_name,
                block_size=self._bs,
                max_blocks=self._max_blocks,
                cached_blocks=self._ids.count,
                pinned_blocks=self._prot.pinned_blocks,
                locked_blocks=self._prot.locked_blocks,
                evictable_blocks=self.num_evictable_blocks,
                num_nodes=self._num_entries,
                memory_bytes=self._memory_bytes(),
                policy=self._policy.name,
            )

    # --------------------------------------------------------------- insert help
    def _finish_insert(
        self,
        tokens: Sequence[int],
        nb: int,
        path: list[Any],
        all_ids: list[int],
        returned: list[int],
        target: Any,
        pin: bool,
        lock: bool,
        namespace: Namespace,
        now: float,
        description: str | None,
        shown: Sequence[int],
    ) -> PrefixNode:
        self._counters.inserts += 1
        if path:
            self._touch(path, now)
        handle = self._take_lock(target, nb) if lock else None
        is_pinned = False
        if pin and nb:
            is_pinned = self.pin_prefix(tokens[: nb * self._bs], namespace=namespace,
                                        description=description)
        elif target is not None:
            is_pinned = target.pin_ref > 0
        return PrefixNode(
            token_ids=shown[: nb * self._bs],
            kv_block_ids=all_ids,
            returned_block_ids=returned,
            is_pinned=is_pinned,
            ref_count=target.lock_ref if target is not None else 0,
            last_access_time=now,
            namespace=namespace,
            lock=handle,
        )
