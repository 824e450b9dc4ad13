"""The shared contract suite: every index kind (radix and hashed, several block sizes)."""

from __future__ import annotations

import pytest

from prefixkv.cache import BlockPool, PinError, PrefixCache


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_satisfies_protocol(make):
    assert isinstance(make(), PrefixCache)


def test_seed_004_system_prompt_scenario(make):
    """Seed 004: a system prompt and three user prompts; later ones match the system prompt."""
    bs = make.bs
    cache = make(1000)
    pool = BlockPool(1000)
    system = seq(1, 8 * bs)
    prompts = [system + seq(100 * k, 3 * bs) for k in (1, 2, 3)]
    m = cache.match_prefix(prompts[0])
    assert m.match_length == 0 and m.remaining_tokens == prompts[0]
    ids = pool.allocate(len(prompts[0]) // bs)
    cache.insert_prefix(prompts[0], ids)
    for p in prompts[1:]:
        m = cache.match_prefix(p)
        assert m.match_length >= len(system)
        assert m.matched_tokens == p[: m.match_length]
        assert m.remaining_tokens == p[m.match_length :]
        assert list(m.matched_kv_blocks) == ids[: len(system) // bs]
    assert cache.get_hit_rate() >= 0.6
    stats = cache.get_stats()
    assert stats.queries == 3 and stats.hits == 2
    assert stats.token_hit_rate == pytest.approx(2 * len(system) / sum(map(len, prompts)))
    assert stats.avg_match_length == len(system)


def test_match_length_is_block_aligned_and_trailing_partial_not_cached(make):
    bs = make.bs
    cache = make()
    toks = seq(1, 3 * bs + (bs - 1))
    node = cache.insert_prefix(toks, [5, 6, 7])
    assert node.token_ids == toks[: 3 * bs] and list(node.kv_block_ids) == [5, 6, 7]
    m = cache.match_prefix(toks + [999])
    assert m.match_length == 3 * bs and m.match_length % bs == 0


def test_insert_wrong_block_count_names_both_lengths(make):
    cache = make()
    bs = make.bs
    with pytest.raises(ValueError, match=rf"2 ids.*{3 * bs} tokens"):
        cache.insert_prefix(seq(0, 3 * bs), [1, 2])
    assert cache.num_cached_blocks == 0


def _bad_inputs(bs):
    nb = 3
    good = seq(0, nb * bs)
    return [
        ("negative token", [-1] + good[1:], [0, 1, 2], "non-negative"),
        ("float token", [1.5] + good[1:], [0, 1, 2], "ints"),
        ("string", "abc" * bs, [0], "sequence of ints"),
        ("repeated id", good, [0, 1, 0], "repeated"),
        ("id too large", good, [0, 1, 64], "out of range"),
        ("negative id", good, [0, -3, 1], "out of range"),
        ("float id", good, [0, 1.0, 2], "ints"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_bad_arguments_raise_and_change_nothing(make, case):
    bs = make.bs
    cache = make(64)
    cache.insert_prefix(seq(100, 2 * bs), [40, 41])
    before = cache.get_stats()
    _, toks, ids, msg = _bad_inputs(bs)[case]
    with pytest.raises(ValueError, match=msg):
        cache.insert_prefix(toks, ids)
    after = cache.get_stats()
    assert after.cached_blocks == before.cached_blocks and after.inserts == before.inserts
    if msg in ("non-negative", "ints") and isinstance(toks[0], float) is False and toks[0] < 0:
        with pytest.raises(ValueError):
            cache.match_prefix([-1] * (2 * bs))
    cache.check_invariants()


def test_bad_constructor_arguments(make):
    with pytest.raises(ValueError, match="max_blocks"):
        make(0)
    with pytest.raises(ValueError, match="max_blocks"):
        make(-5)
    with pytest.raises(ValueError, match="eviction_policy"):
        make(8, eviction_policy="nope")


def test_block_id_cached_elsewhere_is_rejected(make):
    bs = make.bs
    cache = make()
    cache.insert_prefix(seq(0, 2 * bs), [1, 2])
    with pytest.raises(ValueError, match="already cached"):
        cache.insert_prefix(seq(500, 2 * bs), [3, 2])
    assert cache.match_prefix(seq(500, 2 * bs)).match_length == 0


def test_duplicate_blocks_are_returned_to_the_caller(make):
    """Inserting blocks already cached under other ids keeps one copy and returns the rest."""
    bs = make.bs
    cache = make()
    toks = seq(0, 4 * bs)
    cache.insert_prefix(toks[: 2 * bs], [1, 2])
    node = cache.insert_prefix(toks, [7, 8, 9, 10])
    assert list(node.kv_block_ids) == [1, 2, 9, 10]
    assert node.returned_block_ids == [7, 8]
    assert not cache.is_cached(7) and not cache.is_cached(8)
    assert cache.is_cached(9) and cache.num_cached_blocks == 4
    # re-confirming with the cached ids returns nothing
    again = cache.insert_prefix(toks, [1, 2, 9, 10])
    assert again.returned_block_ids == [] and cache.num_cached_blocks == 4


def test_lru_evicts_least_recent_leaf_and_match_counts_as_use(make, clock):
    bs = make.bs
    cache = make()
    a, b = seq(0, 2 * bs), seq(1000, 2 * bs)
    cache.insert_prefix(a, [1, 2])
    clock.advance()
    cache.insert_prefix(b, [3, 4])
    clock.advance()
    cache.match_prefix(a)  # a is now the most recent
    assert list(cache.evict(2)) == [4, 3]  # b's blocks, deepest first
    assert cache.match_prefix(a).match_length == 2 * bs
    assert cache.match_prefix(b).match_length == 0


def test_eviction_is_leaves_first_and_tail_first(make, clock):
    bs = make.bs
    cache = make()
    shared = seq(0, 2 * bs)
    cache.insert_prefix(shared + seq(100, bs), [1, 2, 3])
    cache.insert_prefix(shared + seq(200, bs), [1, 2, 4])
    freed = list(cache.evict(1))
    assert freed in ([3], [4])
    freed += list(cache.evict(3))
    # the shared blocks go only after both tails, and the deeper shared block first
    assert freed[:2] in ([3, 4], [4, 3]) and freed[2:] == [2, 1]
    assert cache.num_cached_blocks == 0


def test_locked_blocks_are_never_evicted(make):
    bs = make.bs
    cache = make()
    toks = seq(0, 3 * bs)
    cache.insert_prefix(toks, [1, 2, 3])
    m = cache.match_prefix(toks[: 2 * bs], lock=True)
    assert list(m.matched_kv_blocks) == [1, 2]
    assert cache.num_evictable_blocks == 1
    assert list(cache.evict(10)) == [3]
    assert cache.get_stats().locked_blocks == 2
    cache.unlock(m)
    with pytest.raises(ValueError, match="already released"):
        cache.unlock(m)
    assert sorted(cache.evict(10)) == [1, 2]


def test_insert_with_lock_protects_the_new_blocks(make):
    bs = make.bs
    cache = make()
    node = cache.insert_prefix(seq(0, 2 * bs), [1, 2], lock=True)
    assert node.ref_count == 1
    assert list(cache.evict(5)) == []
    cache.unlock(node)
    assert sorted(cache.evict(5)) == [1, 2]


def test_unlock_without_lock_is_an_error(make):
    cache = make()
    m = cache.match_prefix([1, 2, 3])
    with pytest.raises(ValueError, match="no lock"):
        cache.unlock(m)


def test_pinning_survives_eviction_and_budget(make):
    bs = make.bs
    cache = make(20, max_pinned_blocks=3)
    system = seq(0, 2 * bs)
    cache.insert_prefix(system + seq(100, bs), [1, 2, 3])
    assert cache.pin_prefix(system, description="system prompt") is True
    assert [p.description for p in cache.list_pinned()] == ["system prompt"]
    assert cache.get_stats().pinned_blocks == 2
    assert list(cache.evict(10)) == [3]
    assert cache.match_prefix(system).match_length == 2 * bs
    # beyond budget: False with a reason
    cache.insert_prefix(seq(500, 2 * bs), [5, 6])
    assert cache.pin_prefix(seq(500, 2 * bs)) is False
    assert "max_pinned_blocks" in (cache.last_pin_error or "")
    with pytest.raises(PinError):
        cache.pin(seq(500, 2 * bs))
    # uncached prefix: False with a reason
    assert cache.pin_prefix(seq(9000, bs)) is False
    assert "not cached" in (cache.last_pin_error or "")
    assert cache.unpin_prefix(system) is True
    assert cache.unpin_prefix(system) is False
    assert sorted(cache.evict(10)) == [1, 2, 5, 6]


def test_insert_with_pin(make):
    bs = make.bs
    cache = make(20)
    node = cache.insert_prefix(seq(0, 2 * bs), [1, 2], pin=True)
    assert node.is_pinned
    assert list(cache.evict(5)) == []


def test_namespaces_never_match_each_other(make):
    bs = make.bs
    cache = make()
    toks = seq(0, 2 * bs)
    cache.insert_prefix(toks, [1, 2], namespace="tenant-a")
    assert cache.match_prefix(toks, namespace="tenant-b").match_length == 0
    assert cache.match_prefix(toks).match_length == 0
    assert cache.match_prefix(toks, namespace="tenant-a").match_length == 2 * bs
    node = cache.insert_prefix(toks, [3, 4], namespace="tenant-b")
    assert node.returned_block_ids == []


def test_partial_tokens_of_next_block(make):
    bs = make.bs
    cache = make()
    toks = seq(0, 3 * bs)
    cache.insert_prefix(toks, [1, 2, 3])
    query = toks[: bs] + toks[bs : bs + bs // 2] + [9999] * bs
    m = cache.match_prefix(query)
    assert m.match_length == bs
    if bs > 1:
        assert m.partial_tokens == bs // 2 and m.partial_block_id == 2
        assert m.num_cached_tokens == bs + bs // 2
    else:
        assert m.partial_tokens == 0 and m.partial_block_id is None


def test_partial_source_is_locked_with_the_match(make):
    bs = make.bs
    if bs == 1:
        pytest.skip("token-granular: no partial blocks")
    cache = make()
    toks = seq(0, 2 * bs)
    cache.insert_prefix(toks, [1, 2])
    m = cache.match_prefix(toks[: bs + 1] + [7777], lock=True)
    assert m.partial_block_id == 2
    assert list(cache.evict(5)) == []
    cache.unlock(m)
    assert list(cache.evict(5)) == [2, 1]


def test_reset_drops_everything_unlocked(make):
    bs = make.bs
    cache = make()
    cache.insert_prefix(seq(0, 2 * bs), [1, 2], pin=True)
    node = cache.insert_prefix(seq(100, bs), [3], lock=True)
    freed = cache.reset()
    assert sorted(freed) == [1, 2]
    assert cache.list_pinned() == [] and cache.num_cached_blocks == 1
    cache.unlock(node)
    assert list(cache.evict(1)) == [3]


def test_stats_fields(make):
    bs = make.bs
    cache = make(50)
    cache.insert_prefix(seq(0, 2 * bs), [1, 2])
    cache.match_prefix(seq(0, 2 * bs))
    cache.match_prefix(seq(500, 2 * bs))
    cache.evict(1)
    s = cache.get_stats()
    assert (s.queries, s.hits, s.inserts) == (2, 1, 1)
    assert s.query_hit_rate == 0.5 and s.token_hit_rate == 0.5
    assert s.cached_blocks == 1 and s.free_blocks == 49 and s.evicted_blocks == 1
    assert s.memory_bytes > 0 and s.policy == "lru" and s.index == make.kind
    assert s.avg_match_us > 0
    cache.reset_stats()
    assert cache.get_stats().queries == 0 and cache.get_hit_rate() == 0.0


def test_lfu_policy_keeps_frequent_prefix(make, clock):
    bs = make.bs
    cache = make(eviction_policy="lfu")
    a, b = seq(0, bs), seq(1000, bs)
    cache.insert_prefix(a, [1])
    for _ in range(3):
        clock.advance()
        cache.match_prefix(a)
    clock.advance()
    cache.insert_prefix(b, [2])  # more recent but used once
    assert list(cache.evict(1)) == [2]


def test_block_pool_with_eviction_owns_every_id_once(make):
    bs = make.bs
    cache = make(8)
    pool = BlockPool(8)
    ids = pool.allocate(8)
    cache.insert_prefix(seq(0, 8 * bs), ids)
    assert pool.num_free == 0
    got = pool.allocate(3, evict_from=cache)
    assert got is not None and len(got) == 3
    assert cache.num_cached_blocks == 5 and pool.num_free == 0
    lock = cache.match_prefix(seq(0, 5 * bs), lock=True)
    assert pool.allocate(1, evict_from=cache) is None  # everything left is locked
    cache.unlock(lock)
    pool.free(got)
    with pytest.raises(ValueError, match="double free"):
        pool.free(got[:1])


def test_array_and_tuple_inputs_behave_like_lists(make):
    from array import array

    bs = make.bs
    cache = make()
    toks = seq(0, 3 * bs)
    cache.insert_prefix(array("I", toks), [1, 2, 3])
    for query in (toks, tuple(toks), array("I", toks), array("q", toks)):
        m = cache.match_prefix(query)
        assert m.match_length == 3 * bs and list(m.matched_kv_blocks) == [1, 2, 3]
        assert m.matched_tokens == toks


def test_token_ids_too_large_or_negative_in_query_are_rejected(make):
    cache = make()
    with pytest.raises(ValueError):
        cache.match_prefix([1, 2, -7, 3] * make.bs)
    with pytest.raises(ValueError):
        cache.insert_prefix([2**40] * make.bs, [0])
    assert cache.num_cached_blocks == 0


def test_lock_with_partial_mid_node_locks_exactly_matched_plus_source(make):
    bs = make.bs
    if bs == 1:
        pytest.skip("token-granular: no partial blocks")
    cache = make()
    toks = seq(0, 4 * bs)
    cache.insert_prefix(toks, [1, 2, 3, 4])
    m = cache.match_prefix(toks[: bs + 1] + [9999] * bs, lock=True)
    assert list(m.matched_kv_blocks) == [1] and m.partial_block_id == 2
    assert cache.get_stats().locked_blocks == 2
    assert list(cache.evict(10)) == [4, 3]  # the blocks past the partial source are not locked
    cache.unlock(m)
    cache.check_invariants()


def test_match_refreshes_recency_of_the_matched_part_only(make, clock):
    bs = make.bs
    cache = make()
    cache.insert_prefix(seq(0, 4 * bs), [1, 2, 3, 4])
    clock.advance()
    cache.insert_prefix(seq(1000, bs), [5])
    clock.advance()
    cache.match_prefix(seq(0, 2 * bs))  # uses blocks 1, 2: blocks 3, 4 keep their old time
    assert list(cache.evict(2)) == [4, 3]
    assert list(cache.evict(1)) == [5]
