"""HostTier (L2): which block key lives in which slot of the host arena, in LRU order.

Pure bookkeeping: the arena itself is a tensor the runner owns
(:class:`~prefixkv.runner.kv_transfer.KVTransfer`); this class only hands out slot numbers.
Ownership: a slot is either free or holds exactly one key. :meth:`reserve` takes a slot for a
new key, evicting the least recently used key that is neither *held* nor *pinned*: a held key
(a request is about to copy it into the pool) is never evicted until :meth:`release`, and a
pinned key (:class:`~prefixkv.tiers.pins.PinnedKeys`, a pinned prefix's block) not until it is
unpinned; a retained key (:class:`~prefixkv.tiers.retained.RetainedKeys`, a soft-retained
prefix's block) only when every other candidate is retained too. Keys are counted per tenant
(:class:`~prefixkv.tiers.quotas.TenantKeys`): with a quota, a tenant over it loses its own
keys first. ``on_drop`` (set by the engine's KV event sink) hears every key that leaves the tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from prefixkv.tiers.pins import PinnedKeys
from prefixkv.tiers.quotas import DEFAULT_TENANT, TenantKeys
from prefixkv.tiers.retained import RetainedKeys
from prefixkv.tiers.stats import Residency, TierCounters


class HostTier:
    """Slot index of the host-memory tier, ``capacity`` blocks (``tenant_quota``: blocks a
    tenant keeps before its own go first; ``None``: no quota). Engine thread only."""

    def __init__(self, capacity: int, pinned: PinnedKeys | None = None,
                 tenant_quota: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"kv_offload_size must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._free = list(range(capacity - 1, -1, -1))
        self._held: dict[bytes, int] = {}
        self.pinned = pinned if pinned is not None else PinnedKeys()
        self.counters = TierCounters("host", capacity)
        self.on_drop: Callable[[list[bytes]], None] | None = None  # keys evicted or cleared
        self.retained = RetainedKeys()  # shared with the disk tier by a TieredStore
        self.residency: Residency | None = None  # sampled block lives (kv_cache_metrics)
        self.tenants = TenantKeys(tenant_quota)  # the stored keys per tenant, LRU first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    @property
    def num_held(self) -> int:
        """Keys held by requests loading them (0 whenever no admission is under way)."""
        return len(self._held)

    def reserve(self, key: bytes, tenant: str = DEFAULT_TENANT) -> int | None:
        """A slot for ``key`` of ``tenant`` (a :func:`~prefixkv.tiers.quotas.tenant_label`; the
        caller fills the slot now); ``None`` if ``key`` is stored already or every slot is held
        or pinned. May evict a key that is neither: an over-quota tenant's least recently used
        first, else the least recently used."""
        if key in self._slots:
            self._slots.move_to_end(key)
            self.tenants.touch(key)
            return None
        if not self._free:
            found = self.tenants.victims(
                1, lambda k: k not in self._held and k not in self.pinned, self.retained,
                self._slots)
            if not found:
                self.counters.add(dropped=1)
                return None
            victim = found[0]
            self._free.append(self._slots.pop(victim))
            self.tenants.remove(found)
            self.counters.add(evictions=1)
            if self.on_drop is not None:
                self.on_drop([victim])
            if self.residency is not None:
                self.residency.evicted([victim])
        slot = self._free.pop()
        self._slots[key] = slot
        self.tenants.add(key, tenant)
        if self.residency is not None:
            self.residency.stored([key])
        return slot

    def hold(self, key: bytes) -> int | None:
        """The slot of ``key`` (marked most recently used and held), or ``None`` if absent."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        self._slots.move_to_end(key)
        self.tenants.touch(key)
        self._held[key] = self._held.get(key, 0) + 1
        if self.residency is not None:
            self.residency.hit([key])
        return slot

    def touch(self, chain: Sequence[bytes]) -> None:
        """Mark ``chain`` (one prefix's keys, first block first) the most recently used, its
        first block most of all (a full tier drops a prompt's tail before its head); keys not
        stored are skipped."""
        slots, tenants = self._slots, self.tenants
        for k in reversed(chain):
            if k in slots:
                slots.move_to_end(k)
                tenants.touch(k)

    def release(self, key: bytes) -> None:
        """Undo one :meth:`hold`."""
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
        else:
            self._held.pop(key, None)

    def stored_keys(self) -> list[bytes]:
        """The stored keys, least recently used first."""
        return list(self._slots)

    def clear(self) -> int:
        """Drop every key that is neither held nor pinned; returns how many."""
        pinned = self.pinned.snapshot()
        drop = [k for k in self._slots if k not in self._held and k not in pinned]
        for k in drop:
            self._free.append(self._slots.pop(k))
        self.tenants.remove(drop)
        if drop and self.on_drop is not None:
            self.on_drop(drop)
        return len(drop)
