"""CacheAdmin: the one implementation of the prefix cache's admin operations.

Stats, reset, "is it cached", pin budgets, pin and unpin, soft retention, per-tenant usage,
hit rates and residency metrics live here once; ``LLMEngine`` exposes
them per request namespace, and ``LLM``, ``AsyncEngine`` and the server's admin routes call
those (``LLM.pin_prefix`` and ``AsyncEngine.pin_prefix`` run the same steps: ``prepare_pin``,
prefill with ``PIN_PREFILL`` if it says so, ``pin``; ``PIN_ATTEMPTS`` times).

Single-threaded like the engine: call it on the engine's thread. Pure Python.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from contextlib import suppress

from prefixkv.cache.protocol import PinError, PinnedPrefix
from prefixkv.cache.quotas import TenantUsage
from prefixkv.cache.retention import Retention
from prefixkv.engine.kv_manager import KVManager
from prefixkv.engine.residency import HitRates, ResidencyStats
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.tiers.spec import reset_tiers

PIN_ATTEMPTS = 2
"""Pin = prefill if not cached, then pin; the prefilled blocks may be evicted before the pin
lands, so a pin is tried this many times."""
PIN_PREFILL = SamplingParams(max_tokens=1, temperature=0.0)
"""How a pin computes a prefix that is not cached yet."""


class CacheAdmin:
    """Admin operations on the KV manager's prefix index.

    ``max_pinned_blocks_per_tenant`` caps the blocks one namespace (a ``cache_salt``) may keep
    pinned, on top of the index's global ``max_pinned_blocks``; ``None``: only the global one.
    A tenant's pins count their blocks, shared with its other pins or not.
    """

    def __init__(self, kv: KVManager, max_pinned_blocks_per_tenant: int | None = None) -> None:
        cap = max_pinned_blocks_per_tenant
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ValueError(f"max_pinned_blocks_per_tenant must be an int >= 0 or None, got {cap!r}")
        self.kv = kv
        self.max_pinned_blocks_per_tenant = cap

    def reset_blocks(self) -> int | None:
        """Unpin everything and drop every cached block not in use, and the host tier's
        blocks; returns how many blocks went back to the pool (``None``: caching off)."""
        out = self.reset("local")
        return None if out is None else out["pool"]

    def reset(self, tiers: str | Iterable[str] = "local") -> dict[str, int | None] | None:
        """Unpin everything, drop every cached block not in use, and clear the lower tiers
        ``tiers`` names (``local``: the host tier; ``all``: also disk and remote; or names:
        :func:`~prefixkv.tiers.spec.reset_tiers`, ``ValueError`` naming ``tiers`` otherwise).
        Blocks dropped per tier, ``pool`` first (``None`` with prefix caching off)."""
        names = reset_tiers(tiers)
        return None if self.kv.cache is None else self.kv.reset_cache(names)

    def is_cached(self, token_ids: Sequence[int], namespace: Hashable | None) -> bool:
        """Whether every full block of ``token_ids`` is cached (``ValueError``: caching off)."""
        return self.kv.is_cached(list(token_ids), namespace)

    def lookup(self, token_ids: Sequence[int], namespace: Hashable | None) -> dict[str, int]:
        """Where the prefix of ``token_ids`` is cached: :meth:`KVManager.lookup`."""
        return self.kv.lookup(list(token_ids), namespace)

    def prepare_pin(self, token_ids: Sequence[int], namespace: Hashable | None) -> bool:
        """Refuse a pin that cannot succeed *before* anything is computed for it; returns
        whether its blocks must be prefilled first.

        Raises ``ValueError`` with prefix caching off, and :class:`~prefixkv.cache.PinError`
        when the prefix is shorter than a block, or when pinning it needs more blocks than the
        global budget or the tenant's budget has left. Uncached blocks are certainly unpinned,
        so they count against the budget now.
        """
        cache = self.kv.require_cache()
        bs = self.kv.block_size
        ids = list(token_ids)
        nb = len(ids) // bs
        if nb == 0:
            raise PinError(f"prefix of {len(ids)} tokens is shorter than one block ({bs})")
        cached = min(nb, cache.match_prefix(ids, namespace=namespace).match_length // bs)
        budget = getattr(cache, "max_pinned_blocks", None)
        pinned = cache.get_stats().pinned_blocks
        if budget is not None and pinned + (nb - cached) > budget:
            raise PinError(
                f"pinning this prefix needs at least {nb - cached} more pinned blocks; "
                f"{pinned} of max_pinned_blocks={budget} are pinned"
            )
        cap = self.max_pinned_blocks_per_tenant
        if cap is not None:
            key = ids[: nb * bs]
            used = sum(p.num_blocks for p in cache.list_pinned()
                       if p.namespace == namespace and p.token_ids != key)
            if used + nb > cap:
                raise PinError(
                    f"pinning this prefix ({nb} blocks) would exceed this tenant's budget "
                    f"max_pinned_blocks_per_tenant={cap} ({used} pinned)"
                )
        return cached < nb

    def pin(self, token_ids: Sequence[int], namespace: Hashable | None,
            description: str | None = None) -> PinnedPrefix:
        """Pin the cached full blocks of ``token_ids`` (checked by :meth:`prepare_pin` first);
        :class:`~prefixkv.cache.PinError` says why not (e.g. not cached)."""
        self.prepare_pin(token_ids, namespace)
        return self.kv.pin(list(token_ids), namespace, description)

    def retain(self, token_ids: Sequence[int], namespace: Hashable | None,
               retention: Retention) -> int:
        """Soft-retain the cached full blocks of ``token_ids`` (docs/cache.md, "Retention"),
        in the pool and every lower tier; returns how many blocks are retained (0: not cached;
        a prefix is cached by a request carrying the retention: ``LLM.retain_prefix``).
        :class:`~prefixkv.cache.RetentionError` (a ``ValueError``) past the tenant's quota
        (``max_cached_blocks_per_tenant``); ``ValueError`` with prefix caching off."""
        ids = list(token_ids)
        n = self.kv.require_cache().retain(ids, retention, namespace=namespace)
        tiers = self.kv.tiers
        if n and tiers is not None:
            with suppress(ValueError):  # a namespace with no stable serialisation: pool only
                keys = tiers.keyer.extend([], ids, n, namespace)
                tiers.retain(keys, retention.priority, retention.ttl_s)
        return n

    def tenants(self) -> dict[Hashable | None, TenantUsage]:
        """Cached and retained blocks per tenant (namespace) holding any (empty with prefix
        caching off); a tenant over ``max_cached_blocks_per_tenant`` loses its blocks first."""
        return {} if self.kv.cache is None else self.kv.cache.tenants()

    def tier_tenants(self) -> dict[str, dict[str, int]]:
        """Blocks per tenant label in each lower tier (``{}`` without them; a tenant over its
        tier quota loses its blocks there first): :meth:`TieredStore.tenant_counts`."""
        return {} if self.kv.tiers is None else self.kv.tiers.tenant_counts()

    def hit_rates(self) -> HitRates:
        """Prompt-token hit rates over the last window, per tenant and per ``cache_key``."""
        return self.kv.observer.hits.snapshot()

    def residency(self) -> list[ResidencyStats]:
        """Sampled block residency per tier, the pool first (empty unless
        ``kv_cache_metrics``): lifetime, idle time before eviction, reuse gap."""
        return self.kv.observer.residency()

    def unpin(self, token_ids: Sequence[int], namespace: Hashable | None) -> bool:
        """Unpin a pinned prefix; ``False`` if it was not pinned."""
        return self.kv.unpin(list(token_ids), namespace)

    def list_pinned(self) -> list[PinnedPrefix]:
        """Pinned prefixes, oldest first (empty with prefix caching off)."""
        return [] if self.kv.cache is None else list(self.kv.cache.list_pinned())
