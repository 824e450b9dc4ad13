"""The forest contract: what :class:`~prefixkv.cache.index.PrefixIndex` needs from a structure.

An index is a *forest* of typed *entries* (a radix node holding a run of blocks, or a hashed
block holding one) driven by one :class:`~prefixkv.cache.index.PrefixIndex`. The forest knows
only its shape: how a query walks it, how an entry is cut at a block boundary, how new blocks
are added, and how an evictable leaf loses its tail. Everything else (the lock, lock and pin
counts, the eviction order, the pin registry, held block ids, statistics) is the driver's.

Ownership: a forest never frees or claims block ids itself. ``add`` calls the driver's
``claim`` as its last check (after it, nothing fails) and keeps the owner tag it returns on the
new entry; a split tells the driver that a second entry now holds part of a tag's ids
(``share``); ``drop_tail`` returns the ids it dropped and the driver releases them. Ids travel
as :data:`~prefixkv.cache.held_ids.BlockIds` (``array('I')``). A forest is guarded by its
driver's lock.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from prefixkv.cache.held_ids import ID_TYPECODE, BlockIds, HeldIds
from prefixkv.cache.policies import CacheEntry, EvictionPolicy
from prefixkv.cache.protocol import Namespace

if TYPE_CHECKING:
    from prefixkv.cache.evictable import EvictableHeap
    from prefixkv.cache.retention import Retained
    from prefixkv.cache.eviction import WholeLeaves


class Entry(CacheEntry, Protocol):
    """An entry of a forest: the policy's fields plus links, protection counts and heap slots.

    ``lock_ref`` / ``pin_ref`` count locks and pins on the entry *and its descendants* (see
    :mod:`prefixkv.cache.protection`); ``heap_ver`` / ``in_heap`` belong to the evictable heap.
    A root sentinel (``is_root``) holds no blocks and is never locked, pinned or evicted.
    """

    lock_ref: int
    pin_ref: int
    heap_ver: int
    in_heap: bool
    retention: Retained | None
    """The entry's live soft retention (:mod:`prefixkv.cache.retention`), or ``None``."""
    owner: int
    """The owner tag its ids carry in the driver's :class:`~prefixkv.cache.held_ids.HeldIds`
    (its own or shared with the other parts of a split entry; releasing an entry whole through
    it is O(1)), or 0 when its ids are released one by one."""

    @property
    def parent(self) -> Self | None:
        """The entry above (``None`` or a root sentinel at the top)."""
        ...

    @property
    def num_children(self) -> int:
        """Cached entries directly below."""
        ...

    @property
    def is_root(self) -> bool:
        """Whether this is a namespace's root sentinel."""
        ...

    @property
    def blocks(self) -> Sequence[int]:
        """The block ids held, shallowest first."""
        ...


class EntryState:
    """The fields every entry carries besides its shape: the policy's (recency, frequency,
    age, tick), the protection counts and the evictable heap's slots. Both entry types extend
    it (a slotted record, not a template: it has no methods)."""

    __slots__ = ("access_count", "created_time", "heap_ver", "in_heap", "last_access_time",
                 "lock_ref", "num_children", "pin_ref", "retention", "tick")

    def __init__(self, now: float) -> None:
        self.lock_ref = 0
        self.pin_ref = 0
        self.num_children = 0
        self.last_access_time = now
        self.created_time = now
        self.access_count = 0
        self.tick = 0
        self.heap_ver = 0
        self.in_heap = False
        self.retention: Retained | None = None  # a soft retention's record (retention.py)


E = TypeVar("E", bound=Entry)

ExtraKeys = Sequence[Hashable | None] | None
"""One extra key per block (hashed index only), or ``None``."""

Claim = Callable[[int], tuple[BlockIds, int]]
"""``claim(stop)``: the driver validates and holds the caller's ids from the walk's end up to
position ``stop``, and returns them (a new array, the forest's to keep) with their owner tag."""

Share = Callable[[int, BlockIds], int]
"""``share(owner, ids)``: a new entry takes over ``ids``, part of the run stamped ``owner`` (a
split); the driver returns the tag the new entry keeps."""


def unbound_share(owner: int, ids: BlockIds) -> int:
    """A forest's ``share`` until its driver sets it."""
    raise RuntimeError("a forest's share is set by the index that drives it")


class Walk(Generic[E]):
    """A read-only walk of a forest along a query (what a match found).

    ``path`` holds the entries the match went through, the last one possibly only for its
    first ``last_used`` blocks; ``ids`` the matched block ids. ``partial_entry`` /
    ``partial_index`` locate the cached block whose leading ``partial`` tokens equal the
    query's next tokens (``partial_entry`` is ``None`` when ``partial`` is 0).

    A plain slotted class, not a dataclass: one is built per match, and a dataclass with
    default factories takes twice as long to build.
    """

    __slots__ = ("ids", "last_used", "partial", "partial_entry", "partial_index", "path")

    def __init__(self, last_used: int = 0) -> None:
        self.ids: BlockIds = array(ID_TYPECODE)
        self.path: list[E] = []
        self.last_used = last_used
        self.partial = 0
        self.partial_entry: E | None = None
        self.partial_index = 0


@dataclass(slots=True)
class Added(Generic[E]):
    """What :meth:`Forest.add` stored: ``path`` (walked entries then new ones, shallowest
    first), the cached ``ids`` of the stored blocks, the deepest entry ``target`` (``None``
    when nothing is stored), and ``refile``: existing entries whose evictability or key may
    have changed (one that gained a child, the lower part of a split); the driver re-files
    them in the evictable heap."""

    path: list[E]
    ids: BlockIds
    target: E | None
    refile: list[E] = field(default_factory=list)


class Forest(Protocol[E]):
    """The structure a :class:`~prefixkv.cache.index.PrefixIndex` drives (see module doc)."""

    name: str
    """The index kind in statistics (``"radix"``, ``"hash"``)."""

    share: Share
    """Set by the driver before use: what a split calls for its new upper part (module doc)."""

    @property
    def num_entries(self) -> int:
        """Entries held (root sentinels excluded)."""
        ...

    def as_tokens(self, token_ids: Any) -> Sequence[int]:
        """A query in the forest's working form (container checked; values checked where new)."""
        ...

    def as_query(self, token_ids: Any) -> Sequence[int]:
        """A query for :meth:`walk` only (``match_prefix``): :meth:`as_tokens`, or a form the
        walk reads faster (every value checked all the same)."""
        ...

    def walk(self, tokens: Sequence[int], n: int, namespace: Namespace,
             extra_keys: ExtraKeys) -> Walk[E]:
        """Match the first ``n`` tokens in whole blocks (plus partial rows of the next block);
        ``ValueError`` for ``extra_keys`` the forest does not take, or for any token value not in
        ``[0, 2**32)`` (checked here or by :meth:`as_tokens`). Changes nothing."""
        ...

    def cut(self, entry: E, k: int) -> E:
        """An entry on ``entry``'s path ending exactly after its ``k``-th block (``k >= 1``),
        splitting ``entry`` if needed: ``entry`` keeps the lower part (so handles naming it stay
        valid), a new parent takes the upper part with ``entry``'s counts."""
        ...

    def add(self, tokens: Sequence[int], nb: int, walk: Walk[E], namespace: Namespace,
            extra_keys: ExtraKeys, claim: Claim, now: float) -> Added[E]:
        """Store the ``nb`` full blocks of ``tokens`` beyond ``walk`` (a walk over them),
        holding the caller's ids from ``len(walk.ids)`` to ``stop``. Validates first, then calls
        ``claim(stop)`` (which returns those ids), then changes the forest; ``ValueError``
        before the claim leaves everything unchanged."""
        ...

    def drop_tail(self, entry: E, k: int) -> BlockIds:
        """Remove an evictable leaf's last ``k`` blocks; detach it when none are left.
        Returns their ids shallowest first, as stored (an array no longer the entry's; the
        driver orders and releases them)."""
        ...

    def whole_leaves(self, heap: EvictableHeap, held: HeldIds,
                     policy: EvictionPolicy) -> WholeLeaves | None:
        """A C runner of common whole-leaf eviction steps
        (:data:`~prefixkv.cache.eviction.WholeLeaves`), or ``None``."""
        ...

    def key_at(self, policy: EvictionPolicy, entry: E, depth: int) -> Any:
        """``policy.key(entry)`` as if its blocks below ``depth`` were gone (a probe)."""
        ...

    def memory_bytes(self) -> int:
        """Estimated bytes held by the structure."""
        ...

    def entries(self, namespace: Namespace) -> Iterator[E]:
        """Every entry of ``namespace`` (a tenant's, for its quota), parents before children."""
        ...

    def check(self) -> Iterator[E]:
        """Assert the structural invariants; yield every entry (tests and debugging)."""
        ...
