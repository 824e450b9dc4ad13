"""prefixkv.cache: the prefix-cache core (pure Python, no torch).

Two indexes behind one contract (:class:`PrefixCache`): :class:`RadixPrefixCache` (SGLang's
radix tree, token exact at block size 1) and :class:`HashPrefixCache` (vLLM's chained block
hashes). A :class:`BlockPool` hands out block ids; eviction policies are small objects.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefixkv.cache.block_pool import BlockPool
from prefixkv.cache.hashed import HashPrefixCache
from prefixkv.cache.hashing import HASH_ALGOS, hash_block_chain
from prefixkv.cache.held_ids import BlockIds
from prefixkv.cache.policies import (
    POLICIES,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    make_policy,
)
from prefixkv.cache.policy_ghost import GhostPolicy
from prefixkv.cache.protocol import (
    CacheStats,
    LockHandle,
    PinError,
    PinnedPrefix,
    PrefixCache,
    PrefixMatch,
    PrefixNode,
)
from prefixkv.cache.radix import RadixPrefixCache
from prefixkv.cache.quotas import TenantUsage
from prefixkv.cache.retention import Retention, RetentionError

POLICIES[GhostPolicy.name] = GhostPolicy
INDEXES = ("radix", "hash")


def make_cache(
    index: str = "radix",
    *,
    max_blocks: int,
    block_size: int | None = None,
    eviction_policy: str | EvictionPolicy = "lru",
    hash_algo: str = "sha256",
    max_pinned_blocks: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    max_blocks_per_tenant: int | None = None,
) -> RadixPrefixCache | HashPrefixCache:
    """Build an index by name (``radix`` or ``hash``) with validated arguments."""
    if index == "radix":
        return RadixPrefixCache(max_blocks, 1 if block_size is None else block_size,
                                eviction_policy=eviction_policy,
                                max_pinned_blocks=max_pinned_blocks, clock=clock,
                                max_blocks_per_tenant=max_blocks_per_tenant)
    if index == "hash":
        return HashPrefixCache(max_blocks, 16 if block_size is None else block_size,
                               hash_algo=hash_algo, eviction_policy=eviction_policy,
                               max_pinned_blocks=max_pinned_blocks, clock=clock,
                               max_blocks_per_tenant=max_blocks_per_tenant)
    raise ValueError(f"index must be one of {INDEXES}, got {index!r}")


__all__ = [
    "HASH_ALGOS",
    "INDEXES",
    "POLICIES",
    "BlockIds",
    "BlockPool",
    "CacheStats",
    "EvictionPolicy",
    "FIFOPolicy",
    "GhostPolicy",
    "HashPrefixCache",
    "LFUPolicy",
    "LRUPolicy",
    "LockHandle",
    "PinError",
    "PinnedPrefix",
    "PrefixCache",
    "PrefixMatch",
    "PrefixNode",
    "RadixPrefixCache",
    "Retention",
    "RetentionError",
    "TenantUsage",
    "hash_block_chain",
    "make_cache",
    "make_policy",
]
