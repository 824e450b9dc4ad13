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
