"""Per-tenant quotas in the cache core: a tenant over ``max_blocks_per_tenant`` loses its own
blocks first, so it cannot flush another tenant's; counts per tenant."""

from __future__ import annotations

import pytest

from prefixkv.cache import BlockPool, Retention


def flood(cache, pool, ns, start, count, nb):
    bs = cache.block_size
    for i in range(start, start + count):
        toks = [5000 + i] + [i % 50 + 1] * (nb * bs - 1)
        ids = pool.allocate(nb, evict_from=cache)
        assert ids is not None
        pool.free(cache.insert_prefix(toks, ids, namespace=ns).returned_block_ids)


@pytest.mark.parametrize("quota", [8, None])
def test_one_tenant_cannot_flush_another(make, clock, quota):
    cache = make(24, max_blocks_per_tenant=quota)
    pool = BlockPool(24)
    bs = cache.block_size
    quiet = [7] * (6 * bs)
    pool.free(cache.insert_prefix(quiet, pool.allocate(6), namespace="b").returned_block_ids)
    clock.advance(1)
    for _ in range(10):  # "a" floods: 40 blocks of new prompts through a 24-block pool
        clock.advance(1)
        flood(cache, pool, "a", _ * 4, 4, 1)
    quiet_kept = cache.match_prefix(quiet, namespace="b").match_length == 6 * bs
    if quota is None:  # the regression: LRU alone flushes the quiet tenant
        assert not quiet_kept
        return
    assert quiet_kept
    usage = cache.tenants()
    assert usage["b"].cached_blocks == 6 and usage["a"].cached_blocks == 18
    cache.check_invariants()
    clock.advance(1)
    flood(cache, pool, "c", 100, 2, 4)  # c is within its quota: a, over by 10, pays for it
    usage = cache.tenants()
    assert usage["b"].cached_blocks == 6 and usage["c"].cached_blocks == 8
    assert usage["a"].cached_blocks == 10
    cache.check_invariants()


def test_quota_counts_every_block_once(make, clock):
    cache = make(32, max_blocks_per_tenant=32)
    pool = BlockPool(32)
    flood(cache, pool, ("salt", None), 0, 6, 3)
    flood(cache, pool, None, 10, 6, 3)
    usage = cache.tenants()
    assert sum(u.cached_blocks for u in usage.values()) == cache.num_cached_blocks == 32
    pool.free(cache.reset())
    assert cache.tenants() == {}
    cache.check_invariants()


def test_over_quota_retained_blocks_stay_until_the_rest_is_gone(make, clock):
    cache = make(16, max_blocks_per_tenant=6)
    pool = BlockPool(16)
    bs = cache.block_size
    keep = [9] * (3 * bs)
    pool.free(cache.insert_prefix(keep, pool.allocate(3), namespace="a",
                                  retention=Retention(ttl_s=100)).returned_block_ids)
    flood(cache, pool, "a", 0, 12, 1)  # a over its quota: its unretained blocks go first
    assert cache.match_prefix(keep, namespace="a").match_length == 3 * bs
    assert cache.tenants()["a"].retained_blocks == 3
    cache.check_invariants()
