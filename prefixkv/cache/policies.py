"""Eviction policies: each one is a sort key over a cache entry, plus optional hooks.

An index keeps its *evictable leaves* (cached, unlocked, unpinned, no cached child) in a heap
ordered by ``policy.key(entry)``; the smallest key is evicted first. A key is computed when an
entry becomes an evictable leaf and again whenever it is accessed while it is one, so a key
must depend only on the entry's fields (and on state the policy keeps through its hooks), not
on the current time.

The entry passed in is a radix node or a hashed block; both expose:

* ``last_access_time`` (float, the index clock at the last match or insert that reached it)
* ``access_count`` (int, matches and inserts that reached it)
* ``depth`` (int, blocks from the root through the entry's deepest block)
* ``num_blocks`` (int, blocks the entry holds: 1 for a hashed block)
* ``created_time`` (float)
* ``tick`` (int, a global counter value at the last access: a total order on accesses)

Hooks (all optional no-ops here): ``on_access(entry)`` after each match/insert that reaches
an entry, ``on_evict(entry)`` when an entry leaves the index.

Declarations (class attributes, both ``False`` unless a policy sets them; see
:class:`EvictionPolicy`): ``monotone_keys`` (a touch never lowers a key, so matches need not
re-file leaves) and ``depth_monotone_keys`` (the key reads the blocks only through ``depth``
and grows as it shrinks, so eviction frees a leaf's whole run of blocks in one step). A new
policy declares what holds for its key; declaring neither is always correct, only slower.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class CacheEntry(Protocol):
    """The fields a policy may read (see the module docstring)."""

    last_access_time: float
    access_count: int
    created_time: float
    tick: int

    @property
    def depth(self) -> int:
        """Blocks from the root through the entry's deepest block."""
        ...

    @property
    def num_blocks(self) -> int:
        """Blocks the entry holds."""
        ...


class EvictionPolicy:
    """Base of the shipped policies: a name, a key, and no-op hooks.

    Subclasses override :meth:`key`; policies with side state also override the hooks.
    """

    name = "base"
    monotone_keys = False
    """``True`` if an entry's key never decreases while it stays in the index (a touch can only
    raise it). The index then skips re-filing an entry on every match and refreshes its key
    lazily, when it reaches the top of the eviction heap. Assumes the clock never goes back."""

    depth_monotone_keys = False
    """``True`` if a key depends on an entry's blocks only through ``depth``, and never decreases
    as ``depth`` decreases (trimming a leaf's deepest block can only raise its key: "deeper
    first" as a tie-break, as the shipped policies do). Eviction then frees a leaf's whole run
    of blocks in one step: it probes the key at a few smaller depths (an object that answers
    ``depth`` itself and every other field from the entry) instead of re-filing the leaf after
    each block, so evicting a 1,024-block leaf at block size 1 costs O(log 1024) key calls. A
    policy whose key reads per-block state can still declare it if it reads the block at
    ``depth`` (as ``ghost`` and ``experts`` do: a probe moves ``depth``); one that reads the
    entry's last block whatever ``depth`` says leaves it ``False`` and gets the per-block
    order, re-checked after every block."""

    depth_free_head = False
    """``True`` if the key is a tuple whose first component never depends on ``depth`` (LRU's
    access time, LFU's count, FIFO's creation time). With ``depth_monotone_keys`` too, a radix
    index then frees a whole leaf in C when that component is strictly below the next leaf's
    (every probe of the leaf is then below the next key): :meth:`frees_whole_leaves_in_c`."""

    key_epoch = 0
    """Bumped by a policy whose keys can change without a touch of the entry (``experts``
    switching experts); the evictable heap then re-checks its top's key."""

    def key(self, entry: CacheEntry) -> Any:
        """Sort key; the entry with the smallest key is evicted first."""
        raise TypeError(f"{type(self).__name__} must define key()")

    direct_depth_key = False
    """``True`` if :meth:`key_at_depth` is defined: eviction's key probes (``key`` as if the
    entry's deepest blocks were gone) then call it instead of moving the entry's depth and
    calling :meth:`key` (two calls and two attribute writes fewer per evicted leaf)."""

    def key_at_depth(self, entry: CacheEntry, depth: int) -> Any:
        """``key(entry)`` as if ``entry.depth`` were ``depth`` (with ``direct_depth_key``)."""
        raise TypeError(f"{type(self).__name__} declares no direct_depth_key")

    def direct_key_at_depth(self) -> Callable[[Any, int], Any] | None:
        """:meth:`key_at_depth` when it can stand for :meth:`key`: declared, and defined by the
        class that defines ``key`` (a subclass that overrides only ``key`` gets ``None``)."""
        if not self.direct_depth_key:
            return None
        return self.key_at_depth if self._declared_with_key("key_at_depth") else None

    def _declared_with_key(self, name: str) -> bool:
        """Whether the class that defines ``key`` also defines ``name`` (a subclass overriding
        only ``key`` does not inherit a declaration made about its parent's key)."""
        mro = type(self).__mro__
        by_key = next(c for c in mro if "key" in c.__dict__)
        return by_key is next(c for c in mro if name in c.__dict__)

    def frees_whole_leaves_in_c(self) -> bool:
        """Whether eviction may free whole leaves in C: ``depth_monotone_keys`` and
        ``depth_free_head`` hold, ``depth_free_head`` declared by the class that defines ``key``
        (a subclass overriding only ``key`` gets ``False``). (An ``on_evict`` hook keeps the
        Python loop too: the evictor takes the C runner only without one.)"""
        return (self.depth_monotone_keys and self.depth_free_head
                and self._declared_with_key("depth_free_head"))

    def on_access(self, entry: CacheEntry) -> None:
        """Called after a match or insert reached ``entry`` (its fields are already updated)."""

    def on_evict(self, entry: CacheEntry) -> None:
        """Called when ``entry`` leaves the index."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first; ties go to the deeper entry (vLLM's tail-first rule)."""

    name = "lru"

    monotone_keys = True
    depth_monotone_keys = True
    direct_depth_key = True
    depth_free_head = True

    def key(self, entry: CacheEntry) -> Any:
        return (entry.last_access_time, -entry.depth, entry.tick)

    def key_at_depth(self, entry: CacheEntry, depth: int) -> Any:
        return (entry.last_access_time, -depth, entry.tick)


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, then least recent, then deepest."""

    name = "lfu"

    monotone_keys = True
    depth_monotone_keys = True
    direct_depth_key = True
    depth_free_head = True

    def key(self, entry: CacheEntry) -> Any:
        return (entry.access_count, entry.last_access_time, -entry.depth, entry.tick)

    def key_at_depth(self, entry: CacheEntry, depth: int) -> Any:
        return (entry.access_count, entry.last_access_time, -depth, entry.tick)


class FIFOPolicy(EvictionPolicy):
    """Oldest insertion first, then deepest."""

    name = "fifo"

    monotone_keys = True
    depth_monotone_keys = True
    direct_depth_key = True
    depth_free_head = True

    def key(self, entry: CacheEntry) -> Any:
        return (entry.created_time, -entry.depth, entry.tick)

    def key_at_depth(self, entry: CacheEntry, depth: int) -> Any:
        return (entry.created_time, -depth, entry.tick)


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """Resolve a policy name (``lru``, ``lfu``, ``fifo``, ...) or pass an instance through."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if isinstance(policy, str) and policy.lower() in POLICIES:
        return POLICIES[policy.lower()]()
    raise ValueError(
        f"eviction_policy must be one of {sorted(POLICIES)} or an EvictionPolicy, got {policy!r}"
    )


# Policies in their own modules register here (they import EvictionPolicy from above).
from prefixkv.cache.policy_experts import ExpertsPolicy

POLICIES[ExpertsPolicy.name] = ExpertsPolicy
