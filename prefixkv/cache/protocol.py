"""The prefix-cache contract: result records and the protocol every index obeys.

Seed 004's protocol is the public face (``match_prefix``, ``insert_prefix``, ``evict_lru``,
``pin_prefix``, ``get_hit_rate``); the rest is what an engine needs to use it safely.

Terms
-----
* A *block* holds ``block_size`` consecutive tokens. ``kv_block_ids[i]`` holds tokens
  ``[i * block_size, (i + 1) * block_size)`` of a sequence. Only full blocks are cached.
* Block ids are ints in ``[0, max_blocks)``; the index never invents ids, it only records
  the ids callers hand it. Results carry them as a ``Sequence[int]``: the shipped indexes
  return an ``array('I')`` (:data:`~prefixkv.cache.held_ids.BlockIds`), built by copying each
  entry's stored id array in C, never one Python int per id. Index it, iterate it, ``len`` it,
  or ``list(...)`` it when a list is needed (``array + list`` is a ``TypeError``).
* A *namespace* (LoRA id, tenant ``cache_salt``, ...) is any hashable value or ``None``.
  Entries in different namespaces never match each other.

Who owns a block id (the ownership table)
----------------------------------------
Every id is in exactly one of three places:

===================  ==========================================================
free                 in the caller's :class:`~prefixkv.cache.block_pool.BlockPool`
caller-private       allocated by a caller and not (or no longer) in the index
cached               recorded by the index; it may also be *locked* (in use by a
                     running request: ref count > 0) and/or *pinned*
===================  ==========================================================

After each call:

* ``match_prefix``: nothing changes hands. With ``lock=True`` the matched blocks (and the
  partial-reuse source block, if any) are locked until ``unlock(match)``.
* ``insert_prefix``: ids at positions that were not cached become *cached* (the index holds
  them). Ids at positions already cached under another id are *not* taken: they are listed in
  ``PrefixNode.returned_block_ids`` and stay caller-private (the caller frees them when it is
  done with them). Ids equal to the cached id at their position are simply re-confirmed.
* ``evict`` / ``evict_lru`` / ``reset``: the returned ids leave the index and become
  caller-private; the caller returns them to its pool. The returned array is the caller's (the
  index keeps no reference to it); so are ``matched_kv_blocks`` and ``kv_block_ids``, which are
  copies, not views of the index.

Eviction never touches a locked or pinned block, and only removes *leaves* (a block no other
cached block depends on).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from prefixkv.cache.policies import EvictionPolicy
    from prefixkv.cache.quotas import TenantUsage
    from prefixkv.cache.retention import Retention

Namespace = Hashable | None
"""Cache partition key (LoRA id, tenant salt, ...). ``None`` is the default namespace."""


class PinError(ValueError):
    """A prefix could not be pinned (not cached, or over the pinned-block budget)."""


@dataclass(slots=True)
class LockHandle:
    """Opaque token for a lock taken by ``match_prefix(lock=True)`` / ``insert_prefix(lock=True)``.

    ``unlock`` consumes it; a handle can be released once.
    """

    target: object
    num_blocks: int
    released: bool = False


@dataclass(slots=True)
class PrefixMatch:
    """Result of ``match_prefix``: the longest cached block-aligned prefix of a query.

    A read-only record by contract; not ``frozen`` only because building a frozen record
    costs about a microsecond, a sixth of a whole match at block size 1.

    Attributes:
        token_ids: the query (as passed in; not copied).
        match_length: number of leading tokens whose KV is cached; a multiple of ``block_size``.
        matched_kv_blocks: block ids holding those tokens, ``match_length // block_size`` of them
            (an ``array('I')`` from the shipped indexes; see the module docstring).
        partial_tokens: how many leading tokens of the *next* block equal the leading tokens of a
            cached block (``0 <= partial_tokens < block_size``). An engine may copy those KV rows
            from ``partial_block_id`` instead of recomputing them.
        partial_block_id: the cached block to copy partial rows from, or ``None``.
        namespace: the namespace that was searched.
        lock: the lock taken when ``lock=True`` was passed, else ``None``.
    """

    token_ids: Sequence[int]
    match_length: int
    matched_kv_blocks: Sequence[int]
    partial_tokens: int = 0
    partial_block_id: int | None = None
    namespace: Namespace = None
    lock: LockHandle | None = field(default=None, repr=False, compare=False)

    @property
    def matched_tokens(self) -> list[int]:
        """The cached leading tokens (seed 004's field)."""
        return list(self.token_ids[: self.match_length])

    @property
    def remaining_tokens(self) -> list[int]:
        """The tokens that still need prefill (seed 004's field)."""
        return list(self.token_ids[self.match_length :])

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV can be reused: full blocks plus partial rows."""
        return self.match_length + self.partial_tokens


@dataclass(frozen=True, slots=True)
class PrefixNode:
    """Result of ``insert_prefix``: the cached state of the inserted prefix after the call.

    Attributes:
        token_ids: the block-aligned prefix that is now cached, a slice of the input (a trailing
            partial block of the input is never cached).
        kv_block_ids: the cached block ids for that prefix, one per block (an ``array('I')``
            from the shipped indexes). Where the caller's id duplicated a block already cached,
            this holds the cached id, not the caller's.
        returned_block_ids: caller ids the index did not take (their blocks were already cached
            under other ids). They stay owned by the caller, who frees them.
        is_pinned: whether the whole prefix is pinned after the call.
        ref_count: lock count on the deepest block after the call.
        last_access_time: clock value of this insert.
        namespace: the namespace inserted into.
        lock: the lock taken when ``lock=True`` was passed, else ``None``.
    """

    token_ids: Sequence[int]
    kv_block_ids: Sequence[int]
    returned_block_ids: list[int]
    is_pinned: bool
    ref_count: int
    last_access_time: float
    namespace: Namespace = None
    lock: LockHandle | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class PinnedPrefix:
    """One pinned prefix, as listed by ``list_pinned`` (``extra_keys``: its blocks' extra keys,
    part of what names it, or ``None``)."""

    token_ids: list[int]
    num_blocks: int
    namespace: Namespace
    description: str | None
    pinned_at: float
    extra_keys: list[Hashable | None] | None = None


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of an index's counters (``get_stats``).

    ``query_hit_rate`` is seed 004's hit rate: queries with ``match_length > 0`` over queries.
    ``token_hit_rate`` is matched tokens over queried tokens. ``avg_match_us`` is the mean time
    of a ``match_prefix`` call inside the index (seed 004's "Avg Query Time"; the walk and its
    bookkeeping, not the lock wait; wall time, so in a busy server it also holds the waits for
    the GIL that other threads hold: 116 us under load for 800-token matches that take 21 us
    offline). ``free_blocks`` counts ids the
    index does not hold (free in a pool or private to callers): ``max_blocks - cached_blocks``.
    """

    index: str
    block_size: int
    max_blocks: int
    queries: int
    hits: int
    query_hit_rate: float
    queried_tokens: int
    matched_tokens: int
    partial_tokens: int
    token_hit_rate: float
    avg_match_length: float
    avg_match_us: float
    inserts: int
    cached_blocks: int
    pinned_blocks: int
    locked_blocks: int
    evictable_blocks: int
    free_blocks: int
    evictions: int
    evicted_blocks: int
    num_nodes: int
    memory_bytes: int
    policy: str
    retained_blocks: int = 0
    """Blocks under a live soft retention (:mod:`prefixkv.cache.retention`; evictable, after
    every other block)."""
    retentions_refused: int = 0
    """Retentions not applied because the tenant had reached its quota."""


@runtime_checkable
class PrefixCache(Protocol):
    """What every prefix index (radix and hashed) provides. Thread safe: one lock per index.

    Bad arguments raise ``ValueError`` naming the argument and leave the index unchanged.
    """

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def max_blocks(self) -> int:
        """Size of the block-id space; the index holds at most this many blocks."""
        ...

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy in use (its ``name`` says which)."""
        ...

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the index holds now."""
        ...

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks ``evict`` could free now (cached, not locked, not pinned)."""
        ...

    def match_prefix(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        extra_keys: Sequence[Hashable | None] | None = None,
        lock: bool = False,
    ) -> PrefixMatch:
        """Find the longest cached block-aligned prefix of ``token_ids``.

        Counts as a use of the matched blocks for recency and frequency, and as one query in
        the statistics. With ``lock=True`` the matched blocks (and the partial-reuse source)
        are locked atomically with the match; release them with ``unlock``.
        """
        ...

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
        retention: Retention | None = None,
    ) -> PrefixNode:
        """Cache the full blocks of ``token_ids``; ``len(kv_block_ids)`` must equal
        ``len(token_ids) // block_size``. See the module docstring for who owns which id after.
        ``pin=True`` also pins the prefix (with ``description``); ``lock=True`` locks it;
        ``retention`` retains it (:meth:`retain`, within the namespace's quota).
        """
        ...

    def retain(self, token_ids: Sequence[int], retention: Retention, *,
               namespace: Namespace = None,
               extra_keys: Sequence[Hashable | None] | None = None) -> int:
        """Soft-retain the cached full blocks of a prefix (:mod:`prefixkv.cache.retention`):
        evicted only after every unretained block and after lower priorities, until
        ``retention.ttl_s`` after its last hit; returns the blocks covered (0: not cached).
        :class:`~prefixkv.cache.retention.RetentionError` (a ``ValueError``) past the
        namespace's quota."""
        ...

    def tenants(self) -> dict[Namespace, TenantUsage]:
        """Per namespace holding any: cached blocks (counted only with a quota,
        ``max_blocks_per_tenant``; beyond it a tenant's blocks are evicted first) and blocks
        under a live retention."""
        ...

    def unlock(self, ref: PrefixMatch | PrefixNode) -> None:
        """Release the lock taken by ``match_prefix(lock=True)`` or ``insert_prefix(lock=True)``."""
        ...

    def evict(self, num_blocks: int) -> Sequence[int]:
        """Evict up to ``num_blocks`` blocks (leaves first, by the eviction policy).

        Returns the freed ids (an ``array('I')`` from the shipped indexes); the caller owns them. Fewer are returned when fewer are evictable.
        """
        ...

    def evict_lru(self, num_blocks: int) -> Sequence[int]:
        """Seed 004's name for :meth:`evict` (the policy decides the order; LRU by default)."""
        ...

    def pin(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        description: str | None = None,
        extra_keys: Sequence[Hashable | None] | None = None,
    ) -> PinnedPrefix:
        """Pin the cached full blocks of a prefix and return its record (pinning a prefix that
        is already pinned returns the existing record); :class:`PinError` (a ``ValueError``)
        with the reason when the prefix is not cached or the pinned-block budget would be
        exceeded. What an engine calls; :meth:`pin_prefix` is seed 004's boolean form."""
        ...

    def pin_prefix(
        self,
        token_ids: Sequence[int],
        *,
        namespace: Namespace = None,
        description: str | None = None,
        extra_keys: Sequence[Hashable | None] | None = None,
    ) -> bool:
        """Pin the cached full blocks of a prefix; ``False`` (reason in ``last_pin_error``) when
        the prefix is not cached or the pinned-block budget would be exceeded."""
        ...

    def unpin_prefix(self, token_ids: Sequence[int], *, namespace: Namespace = None,
                     extra_keys: Sequence[Hashable | None] | None = None) -> bool:
        """Unpin a prefix pinned before (named by its tokens, namespace and extra keys);
        ``False`` if it was not pinned."""
        ...

    def list_pinned(self) -> list[PinnedPrefix]:
        """The pinned prefixes, oldest first."""
        ...

    def reset(self) -> Sequence[int]:
        """Unpin everything and drop every block that is not locked; returns the freed ids."""
        ...

    def get_hit_rate(self) -> float:
        """Seed 004's hit rate: queries with a non-empty match over all queries."""
        ...

    def get_stats(self) -> CacheStats:
        """A snapshot of the counters."""
        ...

    def reset_stats(self) -> None:
        """Zero the query/insert/eviction counters; the cached contents are unchanged."""
        ...
