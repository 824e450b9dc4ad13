"""Put: what travels down to the lower tiers with a request's newly computed blocks.

The engine hands :meth:`~prefixkv.tiers.store.TieredStore.publish` one :class:`Put` per batch of
blocks: their tenant (the request's namespace, counted against its quota in every tier,
:mod:`prefixkv.tiers.quotas`) and the request's soft retention (:mod:`prefixkv.tiers.retained`).
The disk and remote tiers take both at once; the host tier gets the blocks later, when the pool
evicts them, so :class:`PooledTenants` remembers each published key's tenant until then.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

from prefixkv.tiers.quotas import DEFAULT_TENANT

POOL_TENANTS = 1 << 18
"""Most pool blocks whose tenant :class:`PooledTenants` remembers (the blocks a cache reset
frees are never offloaded, so their entries leave as the oldest)."""


class Retained(Protocol):
    """A soft retention as the tiers read it (``prefixkv.cache.Retention``)."""

    @property
    def priority(self) -> int:
        """0-100: lower goes first among retained blocks."""
        ...

    @property
    def ttl_s(self) -> float:
        """Seconds it lasts from now."""
        ...


@dataclass(frozen=True, slots=True)
class Put:
    """Whose the published blocks are (``tenant``: a namespace, ``cache_salt`` / LoRA adapter;
    ``None``: the default tenant) and how long to retain them (``None``: the policy's order)."""

    tenant: Hashable | None = None
    retention: Retained | None = None


class PooledTenants:
    """Tenant label of each published key still in the pool, until its offload; bounded by
    ``limit`` (the oldest go first). Engine thread only."""

    def __init__(self, limit: int = POOL_TENANTS) -> None:
        self._limit = limit
        self._of: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._of)

    def add(self, keys: Iterable[bytes], tenant: str) -> None:
        """``keys`` entered the pool for ``tenant``."""
        of = self._of
        for k in keys:
            of[k] = tenant
            of.move_to_end(k)
        while len(of) > self._limit:
            of.popitem(last=False)

    def pop(self, key: bytes) -> str:
        """The tenant of ``key`` leaving the pool (:data:`DEFAULT_TENANT` if not known)."""
        return self._of.pop(key, DEFAULT_TENANT)
