"""Lower KV tiers below the engine's pool: host memory (L2), disk (L3), a shared Valkey/Redis
tier. Pure Python (no torch): the runner moves the bytes (``prefixkv.runner.kv_transfer``).
See docs/tiers.md."""

from prefixkv.tiers.codec import CorruptBlockError
from prefixkv.tiers.keys import BlockKeyer
from prefixkv.tiers.pins import PinnedKeys
from prefixkv.tiers.prefetch import Prefetcher
from prefixkv.tiers.put import Put
from prefixkv.tiers.quotas import TenantKeys, tenant_label
from prefixkv.tiers.spec import TierSpec, parse_size, reset_tiers
from prefixkv.tiers.stats import TierStats
from prefixkv.tiers.store import BlockTransfer, TieredStore, TierHit

__all__ = [
    "BlockKeyer",
    "BlockTransfer",
    "CorruptBlockError",
    "PinnedKeys",
    "Prefetcher",
    "Put",
    "TierHit",
    "TierSpec",
    "TenantKeys",
    "TierStats",
    "TieredStore",
    "parse_size",
    "reset_tiers",
    "tenant_label",
]
