"""TenantBlocks: how many cached blocks each tenant (namespace) holds, and its quota.

A tenant is a namespace of the index (a ``cache_salt``, a LoRA adapter, or both). With a quota
(``max_blocks_per_tenant``), a tenant holding more cached blocks than that is *over quota*, and
its blocks beyond the quota are the first an eviction frees (its own evictable leaves, in the
policy's order), so one tenant flooding the pool cannot flush the others: they lose blocks only
once no tenant is over its quota. The same quota caps what a tenant may retain
(:mod:`prefixkv.cache.retention`).

Counting: the tenant of every cached block id is kept in one array (4 bytes an id); an insert
stamps its new ids, an eviction looks its freed ids up (one numpy pass). Kept only with a quota
(an engine always gives one: the whole pool unless ``max_cached_blocks_per_tenant`` is set), so
an index without one pays nothing on its eviction path. Guarded by the index's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixkv.cache.held_ids import BlockIds, new_ids

if TYPE_CHECKING:
    from prefixkv.cache.eviction import Evictor
    from prefixkv.cache.stats import Counters

Tenant = Hashable | None


class TenantBlocks:
    """Cached blocks per tenant over an id space of ``max_blocks`` ids.

    Args:
        max_blocks: the index's id space.
        quota: most cached blocks a tenant may keep before its own are evicted first.
    """

    __slots__ = ("_counts", "_index", "_names", "_of", "quota")

    def __init__(self, max_blocks: int, quota: int) -> None:
        self.quota = quota
        self._of = np.zeros(max_blocks, dtype=np.uint32)  # a cached id's tenant number + 1
        self._names: list[Tenant] = []
        self._index: dict[Tenant, int] = {}
        self._counts: list[int] = []

    def stored(self, tenant: Tenant, ids: BlockIds) -> None:
        """``ids`` entered the index under ``tenant``."""
        if not ids:
            return
        t = self._index.get(tenant)
        if t is None:
            t = self._index[tenant] = len(self._names)
            self._names.append(tenant)
            self._counts.append(0)
        self._of[np.frombuffer(ids, dtype=np.uint32)] = t + 1
        self._counts[t] += len(ids)

    def freed(self, ids: BlockIds) -> None:
        """``ids`` left the index."""
        if not ids:
            return
        if len(self._counts) == 1:  # one tenant: nothing to look up (stale stamps are
            self._counts[0] -= len(ids)  # overwritten when an id is stored again)
            return
        per = np.bincount(self._of[np.frombuffer(ids, dtype=np.uint32)],
                          minlength=len(self._names) + 1)
        for t in np.flatnonzero(per[1:]):
            self._counts[t] -= int(per[t + 1])

    def over(self) -> list[tuple[Tenant, int]]:
        """Tenants over their quota and by how many blocks, most over first."""
        q = self.quota
        if len(self._counts) == 1:
            n = self._counts[0]
            return [(self._names[0], n - q)] if n > q else []
        out = [(self._names[t], n - q) for t, n in enumerate(self._counts) if n > q]
        out.sort(key=lambda x: -x[1])
        return out

    def by_tenant(self) -> dict[Tenant, int]:
        """Cached blocks per tenant holding any."""
        return {self._names[t]: n for t, n in enumerate(self._counts) if n}

    def evict(self, num_blocks: int, evictor: Evictor[Any],
              entries: Callable[[Tenant], Iterable[Any]], counters: Counters) -> BlockIds:
        """The index's ``evict`` with tenants counted: up to each over-quota tenant's excess
        from its own entries first (``entries(tenant)``), then the evictor's order."""
        runs = new_ids()
        for tenant, excess in self.over():
            if len(runs) < num_blocks:
                runs += evictor.evict_among(entries(tenant), min(excess, num_blocks - len(runs)))
                counters.evictions += evictor.entries_freed
        try:
            out = evictor.evict(num_blocks - len(runs))
        finally:
            counters.evictions += evictor.entries_freed
        if runs:
            out = runs + out
        self.freed(out)
        counters.evicted_blocks += len(out)
        return out

    def check(self, entries: Callable[[Tenant], Iterable[Any]]) -> None:
        """Assert the counts agree with the index (``entries(tenant)``: a tenant's entries)."""
        for tenant, n in self.by_tenant().items():
            blocks = [b for e in entries(tenant) for b in e.blocks]
            assert len(blocks) == n, "blocks per tenant"
            assert all(self._of[b] == self._index[tenant] + 1 for b in blocks), "a block's tenant"


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's blocks in an index: cached, and retained (soft retention)."""

    cached_blocks: int
    retained_blocks: int


def tenant_usage(tenants: TenantBlocks | None,
                 retained: Mapping[Tenant, int]) -> dict[Tenant, TenantUsage]:
    """Per tenant holding any: its cached blocks (0 when not counted) and retained ones."""
    cached = {} if tenants is None else tenants.by_tenant()
    return {t: TenantUsage(cached.get(t, 0), retained.get(t, 0))
            for t in [*cached, *(t for t in retained if t not in cached)]}
