"""Soft retention in the cache core: order under pool pressure, priorities, expiry, hits,
pins, quotas, every policy, both index kinds (the ``make`` fixture: radix and hash, block
sizes 1 and 4), with an injected clock."""

from __future__ import annotations

import pytest

from prefixkv.cache import (
    POLICIES,
    BlockPool,
    RadixPrefixCache,
    Retention,
    RetentionError,
)


def prompt(i: int, n: int) -> list[int]:
    """``n`` tokens no other prompt of this module shares (distinct first token)."""
    return [1000 + i] + [i % 97 + 1] * (n - 1)


def put(cache, pool, tokens, **kw):
    """Insert ``tokens`` as an engine does: allocate (evicting when short), insert."""
    nb = len(tokens) // cache.block_size
    ids = pool.allocate(nb, evict_from=cache)
    assert ids is not None
    node = cache.insert_prefix(tokens, ids, **kw)
    pool.free(node.returned_block_ids)
    return node


def retained(cache) -> dict:
    return {t: u.retained_blocks for t, u in cache.tenants().items() if u.retained_blocks}


def cached(cache, tokens) -> bool:
    bs = cache.block_size
    return cache.match_prefix(tokens).match_length == len(tokens) // bs * bs


def test_retained_prefix_survives_floods_until_its_ttl(make, clock):
    cache = make(64)
    pool = BlockPool(64)
    bs = cache.block_size
    keep = prompt(0, 8 * bs)
    put(cache, pool, keep, retention=Retention(priority=10, ttl_s=60))
    assert cache.get_stats().retained_blocks == 8
    for i in range(1, 40):  # floods of new prompts: 8 x 39 blocks through a 64-block pool
        clock.advance(1)
        put(cache, pool, prompt(i, 8 * bs))
    assert cache.get_stats().retained_blocks == 8
    clock.now = 40.0
    assert cached(cache, keep)  # the hit at t=40 renews: it now runs to t=100
    clock.now = 99.0
    for i in range(40, 60):
        put(cache, pool, prompt(i, 8 * bs))
    assert cache.get_stats().retained_blocks == 8
    clock.now = 101.0  # expired: back in the policy's order, the oldest, so the first to go
    assert cache.get_stats().retained_blocks == 0
    put(cache, pool, prompt(60, 8 * bs))
    assert cache.match_prefix(keep).match_length == 0
    cache.check_invariants()


def test_unretained_blocks_go_first_then_low_priority(make, clock):
    cache = make(32)
    pool = BlockPool(32)
    bs = cache.block_size
    low, high, plain = prompt(1, 4 * bs), prompt(2, 4 * bs), prompt(3, 4 * bs)
    put(cache, pool, high, retention=Retention(priority=90, ttl_s=100))
    put(cache, pool, low, retention=Retention(priority=20, ttl_s=100))
    clock.advance(1)
    put(cache, pool, plain)  # the newest, but unretained: evicted first all the same
    assert len(cache.evict(4)) == 4
    assert not cached(cache, plain) and cached(cache, low) and cached(cache, high)
    cache.evict(4)
    assert not cached(cache, low) and cached(cache, high)
    cache.evict(4)
    assert not cached(cache, high)
    assert cache.get_stats().retained_blocks == 0
    cache.check_invariants()


def test_same_priority_goes_in_the_policys_order(make, clock):
    cache = make(32)
    pool = BlockPool(32)
    bs = cache.block_size
    old, new = prompt(1, 2 * bs), prompt(2, 2 * bs)
    put(cache, pool, old, retention=Retention(priority=50, ttl_s=500))
    clock.advance(1)
    put(cache, pool, new, retention=Retention(priority=50, ttl_s=100))  # expires sooner
    cache.evict(2)  # LRU among equal priorities, whatever the expiries
    assert cached(cache, new) and not cached(cache, old)


def test_hits_renew_and_an_expired_retention_decays_to_lru(make, clock):
    cache = make(32)
    pool = BlockPool(32)
    bs = cache.block_size
    a, b = prompt(1, 2 * bs), prompt(2, 2 * bs)
    held_a = list(put(cache, pool, a, retention=Retention(priority=5, ttl_s=10)).kv_block_ids)
    clock.advance(1)
    put(cache, pool, b)
    for t in (8.0, 16.0, 24.0):  # each hit pushes a's expiry 10 s on
        clock.now = t
        assert cached(cache, a)
    clock.now = 33.0
    assert cache.get_stats().retained_blocks == 2
    assert sorted(cache.evict(2)) != sorted(held_a)  # b went, a stays (not matched: no renewal)
    assert all(cache.is_cached(x) for x in held_a)
    put(cache, pool, b)  # b is now newer than a's last hit (t=24)
    clock.now = 34.5  # a expired at 34: plain LRU, older than b: goes first
    assert sorted(cache.evict(2)) == sorted(held_a)
    assert cached(cache, b)
    cache.check_invariants()


def test_pins_still_win(make, clock):
    cache = make(32, max_pinned_blocks=8)
    pool = BlockPool(32)
    bs = cache.block_size
    pinned, kept = prompt(1, 2 * bs), prompt(2, 2 * bs)
    put(cache, pool, pinned, pin=True)
    put(cache, pool, kept, retention=Retention(priority=100, ttl_s=1e6))
    freed = cache.evict(10)
    assert len(freed) == 2 and cached(cache, pinned) and not cached(cache, kept)
    assert cache.retain(pinned, Retention(priority=1, ttl_s=5)) == 2  # a pin and a retention
    assert len(cache.evict(10)) == 0 and cached(cache, pinned)
    cache.unpin_prefix(pinned[: 2 * bs])
    assert cache.get_stats().retained_blocks == 2 and len(cache.evict(10)) == 2
    cache.check_invariants()


def test_retain_a_cached_prefix_and_its_extension(make, clock):
    cache = make(32)
    pool = BlockPool(32)
    bs = cache.block_size
    system = prompt(1, 2 * bs)
    long = system + [7] * (2 * bs)
    put(cache, pool, long)
    assert cache.retain(system + [3] * bs, Retention(ttl_s=50)) == 2  # the cached part
    assert cache.get_stats().retained_blocks == 2
    assert len(cache.evict(2)) == 2  # the unretained extension goes, the retained head stays
    assert cached(cache, system) and cache.match_prefix(long).match_length == 2 * bs
    assert cache.retain(prompt(9, bs), Retention()) == 0  # not cached: nothing retained
    cache.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_orders_retained_blocks_last(policy, clock):
    cache = RadixPrefixCache(40, 2, eviction_policy=policy, clock=clock)
    pool = BlockPool(40)
    keep = prompt(0, 8)
    put(cache, pool, keep, retention=Retention(priority=1, ttl_s=100))
    for i in range(1, 30):
        clock.advance(1)
        put(cache, pool, prompt(i, 8))
        cache.check_invariants()
    assert cached(cache, keep)
    clock.advance(200)
    for i in range(30, 60):
        clock.advance(1)
        put(cache, pool, prompt(i, 8))
    assert cache.get_stats().retained_blocks == 0  # decayed to the policy's own order
    if policy in ("lru", "fifo"):  # (lfu and the others may keep it for its extra hit)
        assert not cached(cache, keep)
    cache.check_invariants()


def test_a_tenant_cannot_retain_more_than_its_quota(make, clock):
    cache = make(64, max_blocks_per_tenant=4)
    pool = BlockPool(64)
    bs = cache.block_size
    put(cache, pool, prompt(1, 3 * bs), namespace="a", retention=Retention())
    big = prompt(2, 2 * bs)
    put(cache, pool, big, namespace="a", retention=Retention())  # 3 + 2 > 4: not retained
    assert retained(cache) == {"a": 3}
    assert cache.get_stats().retentions_refused == 1
    with pytest.raises(RetentionError, match="max_blocks_per_tenant=4"):
        cache.retain(big, Retention(), namespace="a")
    put(cache, pool, prompt(3, 4 * bs), namespace="b", retention=Retention())  # b's own quota
    assert retained(cache) == {"a": 3, "b": 4}
    clock.advance(1000)  # expired: the quota is free again
    assert cache.retain(big, Retention(), namespace="a") == 2
    assert retained(cache) == {"a": 2}
    cache.check_invariants()


def test_bad_retentions_name_the_field():
    with pytest.raises(ValueError, match="priority"):
        Retention(priority=101)
    with pytest.raises(ValueError, match="priority"):
        Retention(priority=True)
    with pytest.raises(ValueError, match="ttl_s"):
        Retention(ttl_s=0)
    with pytest.raises(ValueError, match="ttl_s"):
        Retention(ttl_s=float("inf"))
    cache = RadixPrefixCache(8)
    with pytest.raises(ValueError, match="retention"):
        cache.retain([1, 2], {"ttl_s": 5})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_blocks_per_tenant"):
        RadixPrefixCache(8, max_blocks_per_tenant=-1)


def test_reset_drops_retained_blocks_too(make, clock):
    cache = make(16)
    pool = BlockPool(16)
    put(cache, pool, prompt(1, 2 * cache.block_size), retention=Retention())
    assert len(cache.reset()) == 2
    assert cache.get_stats().retained_blocks == 0 and cache.num_cached_blocks == 0
    cache.check_invariants()
