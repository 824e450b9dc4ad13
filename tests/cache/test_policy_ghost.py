"""GhostPolicy: visits are counted once per visit, survive eviction, and buy lifetime."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from prefixkv.cache import BlockPool, HashPrefixCache, RadixPrefixCache
from prefixkv.cache.policy_ghost import GhostPolicy


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _make(index: str, policy: GhostPolicy, clock: Clock, max_blocks: int = 8):
    if index == "radix":
        return RadixPrefixCache(max_blocks, 1, eviction_policy=policy, clock=clock)
    return HashPrefixCache(max_blocks, 1, hash_algo="builtin", eviction_policy=policy,
                           clock=clock)


def _serve(cache, pool: BlockPool, tokens: list[int]) -> int:
    """The engine's path: match (locked), evict+allocate the rest, insert, unlock."""
    m = cache.match_prefix(tokens, lock=True)
    k = len(m.matched_kv_blocks)
    ids = pool.allocate(len(tokens) - k, evict_from=cache)
    assert ids is not None
    node = cache.insert_prefix(tokens, [*m.matched_kv_blocks, *ids])
    pool.free(node.returned_block_ids)
    cache.unlock(m)
    return k


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


def test_touches_within_min_gap_are_one_visit() -> None:
    pol = GhostPolicy(bonus=10.0, min_gap=1.0)
    b = Block(hash=7)
    for t in (0.0, 0.5, 0.9, 2.0, 2.1, 5.0):
        b.last_access_time = t
        pol.on_access(b)
    assert pol.visits(b) == 3                      # visits at 0, 2 and 5
    assert pol.key(b) == (5.0 + 10.0 * math.log2(3), -1, 0)
    assert pol.visits(Block(hash=8)) == 1          # never seen: plain LRU key
    assert pol.key(Block(hash=8, last_access_time=4.0)) == (4.0, -1, 0)


@pytest.mark.parametrize("index", ["radix", "hash"])
def test_visits_are_remembered_after_eviction(index: str) -> None:
    pol, clock = GhostPolicy(bonus=100.0, min_gap=1.0), Clock()
    cache = _make(index, pol, clock, max_blocks=4)
    pool = BlockPool(4)
    for t in (0.0, 2.0):
        clock.t = t
        _serve(cache, pool, [1, 2])
    pool.free(cache.evict(4))                # everything leaves the index ...
    assert cache.num_cached_blocks == 0
    clock.t = 10.0
    assert _serve(cache, pool, [1, 2]) == 0  # ... the ghost remembers: third visit
    clock.t = 11.0
    _serve(cache, pool, [3, 4])
    clock.t = 12.0
    _serve(cache, pool, [5, 6])              # LRU would evict [1, 2] (older than [3, 4])
    assert cache.match_prefix([1, 2]).match_length == 2
    assert cache.match_prefix([3, 4]).match_length == 0


@pytest.mark.parametrize("index", ["radix", "hash"])
def test_revisited_prefix_outlives_a_newer_one_shot(index: str) -> None:
    pol, clock = GhostPolicy(bonus=100.0), Clock()
    cache = _make(index, pol, clock, max_blocks=4)
    pool = BlockPool(4)
    _serve(cache, pool, [1, 2])
    clock.t = 5.0
    _serve(cache, pool, [1, 2])              # [1, 2] visited twice: +100 lifetime
    clock.t = 10.0
    _serve(cache, pool, [3, 4])              # newer, one visit
    clock.t = 20.0
    _serve(cache, pool, [5, 6])              # needs 2 blocks: LRU would drop [1, 2]
    assert cache.match_prefix([1, 2]).match_length == 2
    assert cache.match_prefix([3, 4]).match_length == 0


def test_lru_order_when_nothing_was_revisited() -> None:
    pol, clock = GhostPolicy(), Clock()
    cache = _make("radix", pol, clock, max_blocks=6)
    pool = BlockPool(6)
    for t, toks in enumerate(([1, 2], [3, 4], [5, 6])):
        clock.t = float(t * 10)
        _serve(cache, pool, toks)
    clock.t = 100.0
    _serve(cache, pool, [7])
    # the least recent prefix loses its deepest block first
    assert cache.match_prefix([1, 2]).match_length == 1
    assert cache.match_prefix([3, 4]).match_length == 2


def test_radix_identity_is_the_same_across_splits() -> None:
    # [1, 2, 3, 4] is one node, split by [1, 2, 9]; the lower half keeps its memoized
    # identities, so the hashed index (one entry per block) and the radix agree on visits
    orders = {}
    for index in ("radix", "hash"):
        pol, clock = GhostPolicy(bonus=100.0), Clock()
        cache = _make(index, pol, clock, max_blocks=6)
        pool = BlockPool(6)
        for t, toks in ((0, [1, 2, 3, 4]), (10, [1, 2, 9]), (20, [1, 2, 3, 4]), (30, [5])):
            clock.t = float(t)
            _serve(cache, pool, toks)
        clock.t = 40.0
        _serve(cache, pool, [6, 7])        # evicts 2 blocks: [9] first (1 visit), then [5]
        orders[index] = [cache.match_prefix(q).match_length
                         for q in ([1, 2, 3, 4], [1, 2, 9], [5], [6, 7])]
    assert orders["radix"] == orders["hash"] == [4, 2, 0, 2]


def test_ghost_capacity_bounds_memory() -> None:
    pol, clock = GhostPolicy(ghost_capacity=5), Clock()
    cache = _make("hash", pol, clock, max_blocks=64)
    pool = BlockPool(64)
    for t in range(10):
        clock.t = float(t * 10)
        _serve(cache, pool, [100 + t, 200 + t])
    assert pol.ghost_size == 5


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"bonus": 0}, "bonus"), ({"bonus": True}, "bonus"), ({"ghost_capacity": 0}, "ghost_capacity"),
    ({"ghost_capacity": 2.5}, "ghost_capacity"), ({"min_gap": -1}, "min_gap"),
])
def test_bad_arguments(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        GhostPolicy(**kwargs)


def test_default_bonus_is_the_mean_revisit_gap() -> None:
    pol = GhostPolicy()
    assert pol.current_bonus == 0.0                # nothing revisited yet: plain LRU
    a, b = Block(hash=1), Block(hash=2)
    for blk, times in ((a, (0.0, 10.0)), (b, (0.0, 30.0, 35.0))):
        for t in times:
            blk.last_access_time = t
            pol.on_access(blk)
    assert pol.current_bonus == pytest.approx((10.0 + 30.0 + 5.0) / 3)
    assert pol.key(a)[0] == pytest.approx(10.0 + 15.0 * 1.0)


class _PerBlock(GhostPolicy):
    """The same policy, evicted block by block and re-filed on every touch (the slow path)."""

    monotone_keys = False
    depth_monotone_keys = False


def test_run_eviction_matches_the_per_block_order() -> None:
    """The declared key shapes hold: freeing whole runs at once and refreshing keys lazily
    caches what the block-by-block path caches (sessions with shared prefixes, dead tails)."""
    from test_policy_experts import session_hits  # tests/cache is on sys.path

    fast, slow = session_hits(GhostPolicy()), session_hits(_PerBlock())
    assert sum(fast) > 0
    assert sum(fast) == pytest.approx(sum(slow), rel=0.01)  # the bonus drifts between touches


def test_node_memos_leave_with_their_nodes() -> None:
    """Identity memos are keyed by node (held until ``on_evict``): evicting every node drops
    them all, and the remembered visits survive it."""
    clock = Clock()
    pol = GhostPolicy()
    cache = RadixPrefixCache(64, 2, eviction_policy=pol, clock=clock)
    for i in range(5):
        clock.t = float(i)
        cache.insert_prefix([1, 2, 3, 4, 10 + i, 11], [0, 1, 2 + i])
    assert pol._memo and pol.ghost_size > 0
    cache.evict(cache.num_evictable_blocks)
    assert cache.num_evictable_blocks == 0
    assert pol._memo == {}
    assert pol.ghost_size > 0
