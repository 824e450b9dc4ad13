"""Run eviction (``PrefixIndex.evict`` with ``depth_monotone_keys``): whole leaves in one
step, the deeper-first tie-break across leaves, and the key probes it relies on."""

from __future__ import annotations

import pytest

from prefixkv.cache import RadixPrefixCache
from prefixkv.cache.eviction import key_at_depth
from prefixkv.cache.policies import FIFOPolicy, LFUPolicy, LRUPolicy


class CountingLRU(LRUPolicy):
    """LRU that counts key calls (a run costs O(log blocks) of them, not O(blocks))."""

    def __init__(self) -> None:
        self.calls = 0

    def key(self, entry):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().key(entry)


def test_a_long_leaf_goes_in_one_step_deepest_first(clock):
    policy = CountingLRU()
    cache = RadixPrefixCache(5000, 1, eviction_policy=policy, clock=clock)
    cache.insert_prefix(list(range(1024)), list(range(1024)))
    clock.advance()
    cache.insert_prefix(list(range(5000, 6024)), list(range(2000, 3024)))
    policy.calls = 0
    freed = list(cache.evict(1500))
    assert freed[:1024] == list(range(1023, -1, -1))  # the older leaf, deepest token first
    assert freed[1024:] == list(range(3023, 3023 - 476, -1))  # then the newer one's tail
    assert policy.calls < 40
    assert cache.get_stats().evictions == 1 and cache.num_cached_blocks == 548
    cache.check_invariants()


def test_equal_times_interleave_runs_by_depth(clock):
    """Two leaves used at the same time: blocks go deepest first across both (vLLM's order)."""
    cache = RadixPrefixCache(100, 1, clock=clock)
    cache.insert_prefix([1] * 10, list(range(10)))
    cache.insert_prefix([2] * 6, list(range(20, 26)))  # same clock value: a tie on time
    freed = list(cache.evict(8))
    # depths 10..7 of the first leaf go before anything of the 6-deep one; at equal depth the
    # older access (tick) goes first, so from depth 6 on the two leaves alternate
    assert freed == [9, 8, 7, 6, 5, 25, 4, 24]
    cache.check_invariants()


def test_generic_key_probe_matches_the_radix_probe(clock):
    cache = RadixPrefixCache(100, 2, clock=clock)
    cache.insert_prefix(list(range(20)), list(range(10)))
    node = next(iter(next(iter(cache._forest._roots.values())).children.values()))
    for depth in (1, 5, 10):
        assert key_at_depth(cache.policy, node, depth) == cache._forest.key_at(cache.policy, node, depth)
    assert node.depth == 10 and node.start_depth == 0  # the probe put it back


@pytest.mark.parametrize("policy", [LRUPolicy(), LFUPolicy(), FIFOPolicy()])
def test_direct_depth_keys_equal_the_probe(clock, policy):
    """The shipped policies' ``key_at_depth`` (what eviction calls) equals ``key`` of a probe."""
    assert policy.direct_depth_key
    cache = RadixPrefixCache(100, 2, eviction_policy=policy, clock=clock)
    cache.insert_prefix(list(range(20)), list(range(10)))
    node = next(iter(next(iter(cache._forest._roots.values())).children.values()))
    for depth in (1, 5, 10):
        assert policy.key_at_depth(node, depth) == key_at_depth(policy, node, depth)
    assert policy.direct_key_at_depth() is not None


def test_a_subclass_overriding_key_gets_the_generic_probe():
    class Shallow(LRUPolicy):  # deeper entries last: the inherited key_at_depth would be wrong
        def key(self, entry):  # type: ignore[no-untyped-def]
            return (entry.last_access_time, entry.depth, entry.tick)

    assert Shallow().direct_key_at_depth() is None and CountingLRU().direct_key_at_depth() is None


def test_owner_tags_survive_splits_and_recycling(clock):
    """Thousands of inserts that split shared prefixes, evicted by whole leaves and trimmed
    tails on a small pool: every node's ids carry its own tag (checked by ``check_invariants``)
    and the tag space is swept and reused many times without freeing another node's ids."""
    import random

    from prefixkv.cache.block_pool import BlockPool

    rng = random.Random(3)
    for bs in (1, 4):
        cache = RadixPrefixCache(96, bs, clock=clock)
        pool = BlockPool(96)
        stems = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
        for i in range(3000):
            tokens = rng.choice(stems)[: rng.randrange(1, 13)] + [rng.randrange(50)
                                                                   for _ in range(rng.randrange(8))]
            m = cache.match_prefix(tokens)
            ids = pool.allocate(len(tokens) // bs - len(m.matched_kv_blocks), evict_from=cache)
            if ids is None:
                continue
            node = cache.insert_prefix(tokens, [*m.matched_kv_blocks, *ids])
            pool.free(node.returned_block_ids)
            clock.advance()
            if i % 97 == 0:
                pool.free(cache.evict(rng.randrange(1, 30)))
                cache.check_invariants()
        cache.check_invariants()
        assert pool.num_free + cache.num_cached_blocks == 96


def test_deepest_first_is_the_same_with_and_without_the_c_helper(monkeypatch):
    """The freed ids of an eviction, each run deepest first: one C pass, numpy for long runs or
    a plain loop for short ones without the helper; all three agree."""
    from array import array

    from prefixkv.cache import eviction

    cases = [[array("I", [7])], [array("I", [1, 2, 3])], [array("I", range(5)), array("I", [9])],
             [array("I", range(i * 700, i * 700 + 600 + i)) for i in range(5)], []]
    joined = [eviction.deepest_first(r) for r in cases]
    assert all(type(j) is array and j.typecode == "I" for j in joined)  # BlockIds either way
    with_c = [list(j) for j in joined]
    if eviction._keypack is not None:  # the C join fills the result array itself
        with pytest.raises(ValueError, match="one 4-byte item"):
            eviction._keypack.reversed_runs(cases[2], array("I", [0, 0]))
    monkeypatch.setattr(eviction, "_keypack", None)
    assert [list(eviction.deepest_first(r)) for r in cases] == with_c
    assert with_c[2] == [4, 3, 2, 1, 0, 9]
    assert with_c[3][:3] == [599, 598, 597] and len(with_c[3]) == 3010
