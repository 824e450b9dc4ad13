"""ExpertsPolicy: experts' keys, shadow caches, switching, and the index contract under it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import test_contract as contract  # the shared contract suite (tests/cache is on sys.path)

from prefixkv.cache import BlockPool, HashPrefixCache, RadixPrefixCache, make_policy
from prefixkv.cache.policy_experts import EXPERTS, ExpertsPolicy


@dataclass(slots=True)
class Block:
    """A cache entry as the policies see it (a hashed block: ``hash`` is its identity)."""

    hash: int
    last_access_time: float = 0.0
    access_count: int = 1
    depth: int = 1
    created_time: float = 0.0
    tick: int = 0
    num_blocks: int = 1


def _touch(pol: ExpertsPolicy, path: list[Block], t: float, tick: int) -> None:
    """One index touch of a path of hashed blocks, shallowest first (as ``_touch`` does)."""
    for b in path:
        b.last_access_time, b.tick = t, tick
        pol.on_access(b)


def _serve(cache, pool: BlockPool, tokens: list[int]) -> int:
    """The engine's path: match (locked), evict+allocate the rest, insert, unlock."""
    bs = cache.block_size
    m = cache.match_prefix(tokens, lock=True)
    k = len(m.matched_kv_blocks)
    ids = pool.allocate(len(tokens) // bs - k, evict_from=cache)
    assert ids is not None
    node = cache.insert_prefix(tokens, [*m.matched_kv_blocks, *ids])
    pool.free(node.returned_block_ids)
    cache.unlock(m)
    return k


def test_registered_and_arguments_checked() -> None:
    assert isinstance(make_policy("experts"), ExpertsPolicy)
    assert make_policy("EXPERTS").chosen == "lru"
    for bad in (dict(experts=()), dict(experts=("lru", "nope")), dict(experts=("lru", "lru")),
                dict(sample_every=0), dict(sample_every=True), dict(window=0),
                dict(margin=-1), dict(ghost_capacity=0), dict(min_gap=-0.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ExpertsPolicy(**bad)  # type: ignore[arg-type]


def test_expert_offsets() -> None:
    pol = ExpertsPolicy(sample_every=1)
    a, b, tail = Block(1, depth=1), Block(2, depth=2), Block(3, depth=3)
    _touch(pol, [a, b, tail], 0.0, 1)     # first visit of a path: tail is a dead tail
    _touch(pol, [a, b], 10.0, 2)          # a and b come back 10 clock units later
    _touch(pol, [a], 30.0, 3)             # a again (gap 20)
    g = pol.gap
    assert g == pytest.approx(40 / 3)     # gaps 10, 10, 20
    assert pol.expert_offset("lru", tail) == 0.0
    assert pol.expert_offset("tail", tail) == -g
    assert pol.expert_offset("tail", b) == 0.0         # interior block: not a tail
    assert pol.expert_offset("ghost", tail) == -g
    assert pol.expert_offset("ghost", a) == pytest.approx(g * 1.584962500721156)  # log2(3)
    assert pol.expert_offset("lru2", a) == -20.0       # previous visit at 10, last at 30
    assert pol.expert_offset("lru2", tail) == -g       # a single visit
    assert pol.expert_offset("lru3", a) == -30.0       # the visit before the previous: 0
    assert pol.expert_offset("lru3", b) == pytest.approx(-10.0 - g)  # two visits: G for one
    assert pol.expert_offset("lru3", tail) == pytest.approx(-2 * g)  # one visit: 2G missing
    assert pol.expert_offset("lru", Block(99)) == 0.0  # never seen
    assert pol.key(a) == (30.0, -1, 3)                 # lru chosen: the plain LRU key


def test_touches_within_min_gap_are_one_visit_and_mark_interior() -> None:
    pol = ExpertsPolicy(min_gap=1.0)
    a, b = Block(1, depth=1), Block(2, depth=2)
    _touch(pol, [a], 0.0, 1)              # a match reaches a only ...
    _touch(pol, [a, b], 0.5, 2)           # ... the insert of the same request adds b
    assert pol.expert_offset("tail", a) == 0.0     # a has a deeper block: not a dead tail
    assert pol.expert_offset("tail", b) == -0.0    # no revisit gap measured yet: G = 0
    assert pol.gap == 0.0 and pol.ghost_size == 2


def _hot_and_scan(rounds: int) -> list[list[int]]:
    """Six hot sessions revisited every 10 requests between one-off scans that flush LRU."""
    out, scan = [], 0
    for r in range(rounds):
        for s in range(6):
            out.append([s * 100_000 + j for j in range(30 + r % 3)])
            for _ in range(9):
                scan += 1
                out.append([10_000_000 + scan * 1000 + j for j in range(40)])
    return out


def _replay(index: str, policy, requests: list[list[int]]) -> list[int]:
    t = [0.0]
    kw = dict(eviction_policy=policy, clock=lambda: t[0], max_pinned_blocks=0)
    cache = (RadixPrefixCache(250, 1, **kw) if index == "radix"
             else HashPrefixCache(250, 1, hash_algo="builtin", **kw))
    pool = BlockPool(250)
    hits = []
    for i, req in enumerate(requests):
        t[0] = float(i)
        hits.append(_serve(cache, pool, req))
    return hits


@pytest.mark.parametrize("index", ["radix", "hash"])
def test_switches_away_from_lru_where_lru_loses(index: str) -> None:
    """One-off scans flush LRU between two visits of a hot session; a visit bonus keeps them."""
    requests = _hot_and_scan(40)
    pol = ExpertsPolicy(sample_every=1)
    hits = _replay(index, pol, requests)
    lru_hits = _replay(index, "lru", requests)
    assert pol.chosen != "lru" and len(pol.history) >= 2
    assert sum(lru_hits) == 0                    # LRU never keeps a hot session
    assert sum(hits[-600:]) > 0.5 * sum(30 + r % 3 for r in range(34, 40)) * 6


def test_stays_on_lru_when_recency_is_right() -> None:
    """A working set that fits, reused in recency order: every expert ties, LRU is kept."""
    t = [0.0]
    pol = ExpertsPolicy(sample_every=1)
    cache = RadixPrefixCache(256, 1, eviction_policy=pol, clock=lambda: t[0], max_pinned_blocks=0)
    pool = BlockPool(256)
    rng = random.Random(3)
    for i in range(600):
        t[0] = float(i)
        s = rng.randrange(4)
        _serve(cache, pool, [s * 1000 + j for j in range(40)])
    assert pol.chosen == "lru" and pol.history == [(float("-inf"), "lru")]


@pytest.mark.parametrize("block_size", [16, 64, 512])
@pytest.mark.parametrize("index", ["radix", "hash"])
def test_block_sizes_and_pool_accounting(index: str, block_size: int) -> None:
    """Engine-sized blocks: ids are owned exactly once, the resident estimate is exact."""
    t = [0.0]
    pol = ExpertsPolicy(sample_every=2)
    blocks = 24
    kw = dict(eviction_policy=pol, clock=lambda: t[0], max_pinned_blocks=0)
    cache = (RadixPrefixCache(blocks, block_size, **kw) if index == "radix"
             else HashPrefixCache(blocks, block_size, **kw))
    pool = BlockPool(blocks)
    rng = random.Random(block_size)
    system = [rng.randrange(50_000) for _ in range(2 * block_size)]
    for i in range(120):
        t[0] = float(i)
        conv = rng.randrange(12)
        tail = [100_000 + conv * 1000 + j for j in range((1 + i % 4) * block_size)]
        _serve(cache, pool, system + tail)
        assert pool.num_free + cache.num_cached_blocks == blocks
    pol._count_resident()
    assert pol.resident_max <= blocks
    assert pol.resident_max >= cache.num_cached_blocks > 0


# ------------------------------------------------------------ the contract suite under it
_POLICY_AGNOSTIC = [
    "test_satisfies_protocol", "test_seed_004_system_prompt_scenario",
    "test_match_length_is_block_aligned_and_trailing_partial_not_cached",
    "test_insert_wrong_block_count_names_both_lengths", "test_bad_arguments_raise_and_change_nothing",
    "test_block_id_cached_elsewhere_is_rejected", "test_duplicate_blocks_are_returned_to_the_caller",
    "test_eviction_is_leaves_first_and_tail_first", "test_locked_blocks_are_never_evicted",
    "test_insert_with_lock_protects_the_new_blocks", "test_unlock_without_lock_is_an_error",
    "test_pinning_survives_eviction_and_budget", "test_insert_with_pin",
    "test_namespaces_never_match_each_other", "test_partial_tokens_of_next_block",
    "test_partial_source_is_locked_with_the_match", "test_reset_drops_everything_unlocked",
    "test_block_pool_with_eviction_owns_every_id_once", "test_array_and_tuple_inputs_behave_like_lists",
    "test_token_ids_too_large_or_negative_in_query_are_rejected",
    "test_lock_with_partial_mid_node_locks_exactly_matched_plus_source",
    "test_lru_evicts_least_recent_leaf_and_match_counts_as_use",
    "test_match_refreshes_recency_of_the_matched_part_only",
]
"""Contract tests that hold for any policy starting on LRU (the stats test names ``lru`` and
the LFU test picks its own policy)."""


@pytest.fixture(params=[EXPERTS, ("ghost", "lru"), ("lru2", "lru")],
                ids=["experts", "ghost-first", "lru2-first"])
def experts_make(request, make):
    """The conftest factory (each index kind and block size) with a fresh ExpertsPolicy."""
    experts = request.param

    def factory(max_blocks: int = 64, **kw):
        kw.setdefault("eviction_policy", ExpertsPolicy(experts, sample_every=1))
        return make(max_blocks, **kw)

    factory.kind = make.kind
    factory.bs = make.bs
    factory.experts = experts
    return factory


_ORDER_TESTS = {"test_lru_evicts_least_recent_leaf_and_match_counts_as_use",
                "test_match_refreshes_recency_of_the_matched_part_only",
                "test_eviction_is_leaves_first_and_tail_first"}


@pytest.mark.parametrize("name", _POLICY_AGNOSTIC)
def test_contract_under_experts_policy(name: str, experts_make, clock) -> None:
    """The shared contract suite with ExpertsPolicy (order tests: only while LRU is chosen)."""
    make = experts_make
    if name in _ORDER_TESTS and make.experts[0] != "lru":
        pytest.skip("asserts LRU order")
    fn = getattr(contract, name)
    params = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    args = {"make": make, "clock": clock}
    if "case" in params:
        for case in range(len(contract._bad_inputs(make.bs))):
            fn(make, case)
        return
    fn(**{p: args[p] for p in params})


class _PerBlock(ExpertsPolicy):
    """The same policy, evicted block by block and re-filed on every touch (the slow path)."""

    monotone_keys = False
    depth_monotone_keys = False


def session_hits(policy) -> list[int]:
    """Blocks hit per request of sessions that share prefixes, grow, come back after varying
    gaps and leave dead tails (radix index, 4-token blocks, 96 blocks: eviction all along)."""
    t = [0.0]
    cache = RadixPrefixCache(96, 4, eviction_policy=policy, clock=lambda: t[0],
                             max_pinned_blocks=0)
    pool = BlockPool(96)
    rng = random.Random(7)
    ctx = {s: [s * 10_000 + j for j in range(4 * rng.randrange(4, 12))] for s in range(12)}
    hits = []
    for i in range(400):
        t[0] += rng.choice((0.5, 2.0, 9.0))
        s = min(rng.randrange(12), rng.randrange(12))  # skewed: low sessions come back more
        ctx[s] += [100_000 + i * 16 + j for j in range(4 * rng.randrange(1, 4))]
        hits.append(_serve(cache, pool, ctx[s] + [7] * 4 * (i % 2)))  # odd: a dead tail
        if len(ctx[s]) > 160:
            ctx[s] = ctx[s][:16]
    return hits


@pytest.mark.parametrize("expert", EXPERTS)
def test_run_eviction_matches_the_per_block_order(expert: str) -> None:
    """The declared key shapes hold: with whole runs freed at once and lazily refreshed keys,
    each fixed expert caches what the block-by-block path caches."""
    fast = session_hits(ExpertsPolicy((expert,), sample_every=1))
    slow = session_hits(_PerBlock((expert,), sample_every=1))
    assert sum(fast) > 0
    if expert in ("lru2", "rate", "lru3"):  # a missing visit's -G may exceed a parent's offset
        assert sum(fast) == pytest.approx(sum(slow), rel=0.05)
    else:
        assert fast == slow


def test_a_switch_rekeys_the_index_at_once() -> None:
    """Keys stored under the previous expert would mix two orders (a held-out trace lost 12%
    to LRU at 1M tokens that way): a switch bumps ``key_epoch`` and the index re-keys."""
    t = [0.0]
    pol = ExpertsPolicy(("lru", "s2"), margin=0.0)
    cache = RadixPrefixCache(8, 1, eviction_policy=pol, clock=lambda: t[0], max_pinned_blocks=0)
    cache.insert_prefix([1, 2], [0, 1])
    t[0] = 10.0
    cache.match_prefix([1, 2])           # A's second visit: G = 10
    t[0] = 15.0
    cache.insert_prefix([5, 6], [2, 3])  # B, seen once: under s2 its key is 15 - G = 5 < 10
    pol.scores = [0.0, 1.0]
    pol._choose(16.0)
    assert pol.chosen == "s2" and pol.key_epoch == 1
    assert sorted(cache.evict_lru(2)) == [2, 3]


def test_replays_are_deterministic() -> None:
    requests = _hot_and_scan(12)
    a, b = ExpertsPolicy(), ExpertsPolicy()
    assert _replay("radix", a, requests) == _replay("radix", b, requests)
    assert a.history == b.history and a.key_epoch == len(a.history) - 1
