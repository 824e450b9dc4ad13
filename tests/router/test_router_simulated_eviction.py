"""cache_aware with simulated eviction: trees bounded by the workers' KV capacity (EPP)."""

from __future__ import annotations

import pytest

from prefixkv.router.cache_aware import CacheAwarePolicy
from prefixkv.router.config import RouterConfig
from prefixkv.router.health import WorkerCacheStats
from prefixkv.router.keys import completion_key

URLS = ["http://a", "http://b"]
IDLE = dict.fromkeys(URLS, 0)


def key(text: str):
    return completion_key({"model": "m", "prompt": text}, 8)


# 160 bytes each: 20 chunks of 8 bytes, 40 estimated tokens (0.5 chunks per token)
A, B, C = ("A" * 160, "B" * 160, "C" * 160)


def policy(**kw) -> CacheAwarePolicy:
    kw.setdefault("max_tree_size", 10_000)
    kw.setdefault("eviction_interval", 60)
    return CacheAwarePolicy(URLS, **kw)


def test_tree_forgets_what_the_worker_evicted() -> None:
    sim = policy(simulate_eviction=True, capacity_tokens=100)  # 100 tokens: 50 chunks
    plain = policy()  # SGLang's bound: nothing trimmed before the interval
    for p in (sim, plain):
        for text in (A, B, C):
            p.select(["http://a"], IDLE, key(text))
    tree = sim.trees["http://a"]
    assert tree.max_size == 50 and tree.size == 50
    # LRU: A, the least recently sent, lost its tail; C is whole
    assert tree.match(key(C)) == 20 and tree.match(key(A)) < 20
    assert plain.trees["http://a"].match(key(A)) == 20
    # so A's next turn is a new prefix for the simulating router, a cache hit for the other
    follow = key(A + " next turn")
    assert plain.select(URLS, IDLE, follow).reason == "cache_hit"
    assert sim.select(URLS, IDLE, follow).reason == "least_load"


def test_capacity_from_worker_stats_and_flag_wins() -> None:
    sim = policy(simulate_eviction=True)
    sim.select(["http://a"], IDLE, key(A))
    assert sim.trees["http://a"].max_size == 10_000  # no capacity known yet
    sim.on_worker_stats("http://a", WorkerCacheStats(60, 3, 0), in_flight=1)
    sim.select(["http://a"], IDLE, key(B))
    # 60 tokens at the estimated 0.5 chunks per token: 30 chunks, trimmed at once
    assert sim.trees["http://a"].max_size == 30 and sim.trees["http://a"].size == 30
    # a measured rate replaces the estimate: 40 chunks routed for 2000 prompt tokens
    sim.on_worker_stats("http://a", WorkerCacheStats(60, 3, 2000), in_flight=1)
    assert sim.trees["http://a"].max_size == 1
    flagged = policy(simulate_eviction=True, capacity_tokens=200)
    flagged.on_worker_stats("http://a", WorkerCacheStats(60, 3, 0), in_flight=1)
    flagged.select(["http://a"], IDLE, key(A))
    assert flagged.trees["http://a"].max_size == 100


def test_token_id_prompts_count_one_token_per_id() -> None:
    sim = policy(simulate_eviction=True, capacity_tokens=16)
    ids = completion_key({"model": "m", "prompt": list(range(64))}, 8)  # 2 ids per chunk
    sim.select(["http://a"], IDLE, ids)
    assert sim.trees["http://a"].max_size == 8


def test_validation() -> None:
    with pytest.raises(ValueError, match="capacity_tokens"):
        policy(simulate_eviction=True, capacity_tokens=0)
    with pytest.raises(ValueError, match="capacity_tokens"):
        RouterConfig(worker_urls=("http://a:1",), capacity_tokens=-5)
    with pytest.raises(ValueError, match="load_factor"):
        RouterConfig(worker_urls=("http://a:1",), load_factor=0.5)
    with pytest.raises(ValueError, match="hash_prefix_chunks"):
        RouterConfig(worker_urls=("http://a:1",), hash_prefix_chunks=0)
    cfg = RouterConfig(worker_urls=("http://a:1",), policy="consistent_hash", load_factor=2)
    assert cfg.policy == "consistent_hash"


def _fill(p: CacheAwarePolicy) -> None:
    """A twice (a session's next turn), then B, then C: 60 chunks over a 50-chunk bound."""
    for text in (A, A, B, C):
        p.select(["http://a"], IDLE, key(text))


def test_replays_the_workers_eviction_policy() -> None:
    lru = policy(simulate_eviction=True, capacity_tokens=100)
    lfu = policy(simulate_eviction=True, capacity_tokens=100, eviction_policy="lfu")
    for p in (lru, lfu):
        _fill(p)
    # LRU drops A (last used before B and C); LFU keeps A (used most) and drops B's tail
    # (as few uses as C, and older)
    assert lru.trees["http://a"].eviction_policy == "lru"
    assert lru.trees["http://a"].match(key(B)) == 20
    assert lru.trees["http://a"].match(key(A)) < 20
    assert lfu.trees["http://a"].eviction_policy == "lfu"
    assert lfu.trees["http://a"].match(key(A)) == 20
    assert lfu.trees["http://a"].match(key(B)) < 20


def test_eviction_policy_from_worker_stats() -> None:
    sim = policy(simulate_eviction=True, capacity_tokens=100)
    sim.on_worker_stats("http://a", WorkerCacheStats(60, 0, 0, eviction_policy="lfu"), 0)
    sim.on_worker_stats("http://b", WorkerCacheStats(60, 0, 0, eviction_policy="novel"), 0)
    assert sim.trees["http://a"].eviction_policy == "lfu"
    assert sim.trees["http://b"].eviction_policy == "lru"  # unknown here: kept
    _fill(sim)
    assert sim.trees["http://a"].match(key(A)) == 20 and sim.trees["http://a"].match(key(B)) < 20
    # the same policy again keeps the tree; the flag wins over the stats; without simulated
    # eviction the trees stay LRU (SGLang's trimming)
    sim.on_worker_stats("http://a", WorkerCacheStats(60, 3, 0, eviction_policy="LFU"), 1)
    assert sim.trees["http://a"].size == 50
    flagged = policy(simulate_eviction=True, eviction_policy="fifo")
    flagged.on_worker_stats("http://a", WorkerCacheStats(60, 0, 0, eviction_policy="lfu"), 0)
    plain = policy()
    plain.on_worker_stats("http://a", WorkerCacheStats(60, 0, 0, eviction_policy="lfu"), 0)
    assert flagged.trees["http://a"].eviction_policy == "fifo"
    assert plain.trees["http://a"].eviction_policy == "lru"


def test_eviction_policy_validation() -> None:
    with pytest.raises(ValueError, match="eviction_policy"):
        policy(simulate_eviction=True, eviction_policy="mru")
    with pytest.raises(ValueError, match="worker_eviction_policy"):
        RouterConfig(worker_urls=("http://a:1",), worker_eviction_policy="mru")
    cfg = RouterConfig(worker_urls=("http://a:1",), simulate_eviction=True,
                       worker_eviction_policy="ghost")
    assert cfg.worker_eviction_policy == "ghost"
