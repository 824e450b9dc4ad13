"""Soft retention: prefixes a client asked to keep, evicted only after every other block.

A *retention* (:class:`Retention`: a priority 0-100 and a TTL in seconds) is applied to a
cached prefix path-wide, as a pin is, but it only orders eviction: an entry holding a live
record (:class:`Retained`) is kept out of the evictable heap, in a :class:`RetainedSet` beside
it, and the eviction loop reaches it only when the heap is empty (so the common eviction path,
the C runner included, never sees it). Among retained leaves the lowest priority goes first,
then the policy's own order (its key when the leaf was filed: a touch re-files it). A hit on a
retained entry renews its expiry (``now + ttl``); once a record expires the entry decays to the
policy's normal order among the unretained. (Ordering a priority by expiry instead turned an
adaptive policy into LRU whenever every session retained: 0.92x its hit rate on the agentic
trace at 3M tokens, against 0.998x this way; docs/benchmarks.md, "Retention".)
Expiry is lazy, by the index's injected clock: records that ran out are cleared when eviction,
statistics or a new retention look (:meth:`RetainedSet.expire`), or when a hit or a re-file
reaches them.

One record per entry: a second retention of the same blocks keeps the higher priority (on a
tie, the longer TTL and the later expiry). Hard pins are untouched and still win: a pinned
entry is never evictable, retained or not. Tenants (namespaces) are charged for the blocks
they retain; a tenant's quota caps them (:meth:`RetainedSet.ask`).

Ownership and locking are the index's: every call here runs under its lock; no block id
changes hands here (the evictor drops the blocks and the caller frees them).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixkv.cache.policies import EvictionPolicy

if TYPE_CHECKING:
    from prefixkv.cache.forest import Entry

MAX_PRIORITY = 100
"""Priorities run from 0 (evicted first among retained blocks) to this (last)."""


class RetentionError(ValueError):
    """A retention refused: the tenant would retain more blocks than its quota."""


@dataclass(frozen=True, slots=True)
class Retention:
    """What a client asks for: keep a prefix ``ttl_s`` seconds after its last hit, evicted
    only after every unretained block, and after retained blocks of lower ``priority``.

    Raises ``ValueError`` naming the field for a priority outside 0-100 or a TTL that is not a
    positive finite number of seconds.
    """

    priority: int = 50
    ttl_s: float = 300.0

    def __post_init__(self) -> None:
        p = self.priority
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= MAX_PRIORITY:
            raise ValueError(f"priority must be an int in [0, {MAX_PRIORITY}], got {p!r}")
        t = self.ttl_s
        if (not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t)
                or t <= 0):
            raise ValueError(f"ttl_s must be a positive finite number of seconds, got {t!r}")


@dataclass(frozen=True, slots=True)
class Retained:
    """An entry's live retention: the request's priority and TTL, when it runs out (the
    index's clock), and the tenant charged for it (its namespace)."""

    priority: int
    ttl_s: float
    expiry: float
    tenant: Hashable | None

    def stronger(self, other: Retained) -> Retained:
        """The record an entry keeps when ``other`` is asked for too (both live)."""
        if other.priority != self.priority:
            return other if other.priority > self.priority else self
        return Retained(self.priority, max(self.ttl_s, other.ttl_s),
                        max(self.expiry, other.expiry), self.tenant)


class RetainedSet:
    """The retained evictable leaves of one index, and who retains how many blocks.

    Args:
        policy: the index's eviction policy (its key breaks ties among retained leaves).
        clock: the index's clock (expiries are on it).
        refile: the index's re-file of an entry (``Protection.refresh``), called for a leaf
            whose record was cleared so that it joins the evictable heap.
    """

    __slots__ = ("_clock", "_expiry", "_heap", "_member", "_policy", "_refile", "_seq",
                 "_watched", "blocks", "by_tenant")

    def __init__(self, policy: EvictionPolicy, clock: Callable[[], float],
                 refile: Callable[[Any], None]) -> None:
        self._policy = policy
        self._clock = clock
        self._refile = refile
        self._heap: list[tuple[Any, ...]] = []  # (priority, policy key, seq, entry)
        self._member: dict[int, int] = {}  # id(leaf) -> seq of its live item
        self._expiry: list[tuple[float, int, Any]] = []  # (expiry, seq, entry holding a record)
        self._seq = 0
        self._watched = 0  # expiry items after the last compaction
        self.blocks = 0
        """Blocks of entries holding a record (expired ones until :meth:`expire` clears them)."""
        self.by_tenant: Counter[Hashable | None] = Counter()

    def __len__(self) -> int:
        """Retained evictable leaves."""
        return len(self._member)

    # ------------------------------------------------------------- records
    def apply(self, path: Iterable[Entry], asked: Retained) -> None:
        """Give every entry of ``path`` ``asked``, or keep its own record where that one is
        stronger (:meth:`Retained.stronger`)."""
        for e in path:
            old = e.retention
            if old is None:
                self._charge(asked.tenant, e.num_blocks)
                e.retention = asked
            else:
                e.retention = old.stronger(asked)
            self._watch(e)

    def renew(self, path: Sequence[Entry], now: float) -> None:
        """A hit reached ``path``: live records run ``ttl`` from now, expired ones are
        cleared."""
        for e in path:
            r = e.retention
            if r is None:
                continue
            if r.expiry > now:
                e.retention = Retained(r.priority, r.ttl_s, now + r.ttl_s, r.tenant)
                self._watch(e)
            else:
                self._clear(e)

    def ask(self, path: list[Entry], retention: Retention, tenant: Hashable | None,
            now: float, quota: int | None, *, strict: bool) -> bool:
        """Retain ``path`` (a prefix's entries, the deepest first) for ``tenant`` unless that
        would take its retained blocks past ``quota`` (``None``: no cap): then ``False``, or
        :class:`RetentionError` when ``strict``."""
        self.expire()
        new = sum(e.num_blocks for e in path if e.retention is None)
        if quota is not None and self.by_tenant[tenant] + new > quota:
            if strict:
                raise RetentionError(
                    f"retaining {new} more blocks would exceed this tenant's quota "
                    f"max_blocks_per_tenant={quota} ({self.by_tenant[tenant]} retained)")
            return False
        self.apply(path, Retained(retention.priority, float(retention.ttl_s),
                                  now + retention.ttl_s, tenant))
        self._refile(path[0])
        return True

    def expire(self) -> None:
        """Clear every record that ran out by now; retained leaves among them join the heap.

        Every entry whose record changes is watched (one item at its expiry); an upper part
        split off an entry shares its record, so the walk up from the lower part clears it."""
        exp = self._expiry
        if not exp:
            return
        now = self._clock()
        while exp and exp[0][0] <= now:
            e = heapq.heappop(exp)[2]
            while e is not None and not e.is_root:
                r = e.retention
                if r is None or r.expiry > now:
                    break
                self._clear(e)
                e = e.parent

    # ------------------------------------------------------------- leaves
    def hold(self, e: Entry) -> bool:
        """File an evictable leaf holding a record among the retained leaves; ``False`` (the
        record cleared) when it has run out: the caller files it in the heap."""
        r = e.retention
        assert r is not None
        if r.expiry <= self._clock():
            self._clear(e, refile=False)
            return False
        self._watch(e)
        self._seq += 1
        self._member[id(e)] = self._seq
        heapq.heappush(self._heap, (r.priority, self._policy.key(e), self._seq, e))
        if len(self._heap) > 2 * len(self._member) + 64:
            self._heap = [it for it in self._heap if self._member.get(id(it[-1])) == it[-2]]
            heapq.heapify(self._heap)
        return True

    def discard(self, e: Entry) -> None:
        """``e`` is no longer a retained evictable leaf (lazily removed)."""
        self._member.pop(id(e), None)

    def holds(self, e: Entry) -> bool:
        """Whether ``e`` is filed as a retained evictable leaf."""
        return id(e) in self._member

    def pop(self) -> Any | None:
        """The retained leaf to evict next (lowest priority, then the policy's order), taken
        out of the set; ``None`` if there is none."""
        heap, member = self._heap, self._member
        while heap:
            item = heapq.heappop(heap)
            e = item[-1]
            if member.get(id(e)) == item[-2]:
                del member[id(e)]
                return e
        return None

    def dropped(self, e: Entry, k: int, whole: bool) -> None:
        """``k`` blocks of ``e`` (holding a record) were evicted; an entry that left the index
        (``whole``) loses its record."""
        r = e.retention
        assert r is not None
        self._charge(r.tenant, -k)
        if whole:
            e.retention = None

    # ------------------------------------------------------------- internals
    def _watch(self, e: Entry) -> None:
        r = e.retention
        assert r is not None
        self._seq += 1
        heapq.heappush(self._expiry, (r.expiry, self._seq, e))
        if len(self._expiry) > 2 * self._watched + 4096:  # drop items of changed records
            self._expiry = [it for it in self._expiry
                            if it[2].retention is not None and it[2].retention.expiry == it[0]]
            heapq.heapify(self._expiry)
            self._watched = len(self._expiry)

    def _clear(self, e: Entry, *, refile: bool = True) -> None:
        r = e.retention
        assert r is not None
        e.retention = None
        self._charge(r.tenant, -e.num_blocks)
        if refile and self._member.pop(id(e), None) is not None:
            self._refile(e)  # a retained leaf decays to the policy's order

    def _charge(self, tenant: Hashable | None, n: int) -> None:
        self.blocks += n
        left = self.by_tenant[tenant] + n
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]

    def check(self, entries: Iterable[Entry], is_leaf: Callable[[Entry], bool]) -> None:
        """Assert the records, the leaves filed here and the block counts agree with
        ``entries`` (every entry of the index)."""
        blocks: Counter[Hashable | None] = Counter()
        for e in entries:
            r = e.retention
            if r is not None:
                blocks[r.tenant] += e.num_blocks
            assert self.holds(e) == (r is not None and is_leaf(e)), "retained set out of sync"
        assert +blocks == +self.by_tenant and sum(blocks.values()) == self.blocks
