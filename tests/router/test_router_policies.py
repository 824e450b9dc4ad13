"""Routing policies as pure logic: fake loads, real approximate trees (no HTTP)."""

from __future__ import annotations

import random

import pytest

from prefixkv.router.policies import (
    CacheAwarePolicy,
    LeastLoadPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
)
from prefixkv.router.tree import PrefixTrees, completion_key

URLS = ["http://a", "http://b", "http://c"]
IDLE = dict.fromkeys(URLS, 0)


def key(text: str):
    return completion_key({"model": "m", "prompt": text})


def cache_aware(**kw) -> CacheAwarePolicy:
    return CacheAwarePolicy(PrefixTrees(URLS, max_size=10_000, eviction_interval=0), **kw)


def test_round_robin_cycles() -> None:
    p = RoundRobinPolicy()
    assert [p.select(URLS, IDLE, key("x")).url for _ in range(4)] == URLS + URLS[:1]


def test_least_load_picks_min_and_rotates_ties() -> None:
    p = LeastLoadPolicy()
    assert p.select(URLS, {"http://a": 3, "http://b": 1, "http://c": 2}, key("x")).url == "http://b"
    assert {p.select(URLS, IDLE, key("x")).url for _ in range(3)} == set(URLS)


def test_random_uses_the_rng_passed_in() -> None:
    a = [RandomPolicy(random.Random(7)).select(URLS, IDLE, key("x")).url for _ in range(5)]
    b = [RandomPolicy(random.Random(7)).select(URLS, IDLE, key("x")).url for _ in range(5)]
    assert a == b


def test_cache_aware_follows_the_prefix() -> None:
    p = cache_aware()
    first = p.select(URLS, IDLE, key("system prompt " * 10 + "question 1"))
    assert first.reason == "least_load" and first.match_ratio == 0.0
    loads = {u: (5 if u == first.url else 0) for u in URLS}  # busier, but within thresholds
    again = p.select(URLS, loads, key("system prompt " * 10 + "question 2"))
    assert again.url == first.url and again.reason == "cache_hit"
    assert 0.8 < again.match_ratio < 1.0


def test_cache_aware_below_threshold_goes_to_least_loaded_then_smallest_tree() -> None:
    p = cache_aware(cache_threshold=0.5)
    p.select(URLS, IDLE, key("aaaa" * 30))  # -> a (all idle, all trees empty)
    d = p.select(URLS, IDLE, key("zz" * 100))  # no match anywhere: b's tree is smaller than a's
    assert d.reason == "least_load" and d.url == "http://b"
    half = key("aaaa" * 30 + "q" * 120)  # matches a at exactly 0.5: not above the threshold
    d = p.select(URLS, {"http://a": 0, "http://b": 1, "http://c": 0}, half)
    assert d.reason == "least_load" and d.url == "http://c"


def test_balance_needs_both_thresholds() -> None:
    p = cache_aware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    hot = key("hot prefix " * 20)
    assert p.select(URLS, IDLE, hot).url == "http://a"
    # abs gap 5 > 4 but 10 <= 8 * 1.5: balanced, the cache wins
    d = p.select(URLS, {"http://a": 10, "http://b": 8, "http://c": 9}, hot)
    assert (d.url, d.reason) == ("http://a", "cache_hit")
    # 6 > 1 * 1.5 but gap 5 is not > 4: balanced
    d = p.select(URLS, {"http://a": 5, "http://b": 1, "http://c": 3}, hot)
    assert (d.url, d.reason) == ("http://a", "cache_hit")
    # gap 6 > 4 and 7 > 1 * 1.5: imbalanced, least loaded despite the cache
    d = p.select(URLS, {"http://a": 7, "http://b": 1, "http://c": 3}, hot)
    assert (d.url, d.reason) == ("http://b", "balance")
    assert p.is_imbalanced([7, 1, 3]) and not p.is_imbalanced([5, 1, 3])


def test_cache_aware_records_the_choice_in_the_chosen_tree_only() -> None:
    p = cache_aware()
    d = p.select(URLS[1:], IDLE, key("only on the candidate"))
    assert d.url == "http://b"
    assert p.trees.sizes()["http://b"] == len(key("only on the candidate"))
    assert p.trees.sizes()["http://a"] == 0


def test_make_policy_and_validation() -> None:
    trees = PrefixTrees(URLS, max_size=100, eviction_interval=0)
    assert make_policy("cache_aware", trees=trees).name == "cache_aware"
    assert make_policy("least_load").name == "least_load"
    with pytest.raises(ValueError, match="policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="trees"):
        make_policy("cache_aware")
    with pytest.raises(ValueError, match="cache_threshold"):
        cache_aware(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        cache_aware(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="urls"):
        RoundRobinPolicy().select([], IDLE, key("x"))
