"""Routing policies as pure logic: fake loads, real approximate trees (no HTTP)."""

from __future__ import annotations

import random

import pytest

from prefixkv.router.cache_aware import CacheAwarePolicy
from prefixkv.router.health import WorkerCacheStats
from prefixkv.router.keys import completion_key
from prefixkv.router.policies import (
    LeastLoadPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
)

URLS = ["http://a", "http://b", "http://c"]
IDLE = dict.fromkeys(URLS, 0)


def key(text: str):
    return completion_key({"model": "m", "prompt": text}, 8)


def cache_aware(**kw) -> CacheAwarePolicy:
    kw.setdefault("eviction_interval", 0)
    kw.setdefault("max_tree_size", 10_000)
    return CacheAwarePolicy(URLS, **kw)


def test_round_robin_cycles() -> None:
    p = RoundRobinPolicy()
    assert [p.select(URLS, IDLE, key("x")).url for _ in range(4)] == URLS + URLS[:1]
    assert p.describe() == {} and p.select(URLS, IDLE, key("x")).match_ratio is None


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
    assert again.match_ratio is not None and 0.8 < again.match_ratio < 1.0


def test_new_prefixes_go_to_the_least_loaded_then_fewest_recent_then_smallest_tree() -> None:
    p = cache_aware(cache_threshold=0.5)
    assert p.select(URLS, IDLE, key("aaaa" * 30)).url == "http://a"  # all equal: first
    d = p.select(URLS, IDLE, key("zz" * 100))  # a got one recently: b
    assert d.reason == "least_load" and d.url == "http://b"
    d = p.select(URLS, {"http://a": 1, "http://b": 1, "http://c": 0}, key("yy" * 10))
    assert d.url == "http://c"  # least in flight first
    d = p.select(URLS, IDLE, key("ww" * 10))
    assert d.url == "http://c"  # recent all 1: the smallest tree (c's 3 chunks)
    d = p.select(URLS, IDLE, key("vv" * 10))
    assert d.url == "http://a"  # a and b have 1 recent, c 2: a's tree (15) < b's (25)
    half = key("aaaa" * 30 + "q" * 128)  # a: 15 chunks + half of one = 124 of 248 bytes
    assert p.select(URLS, IDLE, half).reason == "least_load"


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


def test_a_worker_that_comes_back_gets_its_share_although_every_prompt_matches_elsewhere() -> None:
    p = cache_aware(balance_window=60)
    history = [f"session {i} " * 12 for i in range(6)]  # each turn extends its session

    def turn(candidates: list[str], t: int):
        i = t % 6
        history[i] += f" turn {t}"
        return p.select(candidates, IDLE, key(history[i]))

    for t in range(60):  # b is out of rotation: a and c take every session
        turn(["http://a", "http://c"], t)
    # b is back (its tree is empty): every prompt matches on a or c, loads are equal
    got = [turn(URLS, t) for t in range(60, 240)]
    assert got[0].url == "http://b" and got[0].reason == "share"
    assert got[6].url == "http://b" and got[6].reason == "cache_hit"  # the moved session stays
    later = got[-60:]
    counts = {u: sum(d.url == u for d in later) for u in URLS}
    assert min(counts.values()) >= 5  # nobody below a quarter of a fair share (60 / 3 / 4)
    assert counts["http://b"] >= 10  # b took sessions back
    assert not any(d.reason == "share" for d in later)  # settled: no see-saw
    assert sum(d.reason == "share" for d in got) <= 3


def test_share_test_needs_a_starved_worker_and_one_above_its_share() -> None:
    p = cache_aware(balance_window=60)  # fair share: 60 / 3 = 20
    assert not p.share_imbalanced(20, 20)
    assert not p.share_imbalanced(30, 5)  # 5 is a quarter of a fair share: not starved
    assert p.share_imbalanced(30, 4)
    assert not p.share_imbalanced(20, 0)  # the busiest is not above its share
    assert not cache_aware(balance_window=0).share_imbalanced(50, 0)


def test_cache_aware_records_the_choice_in_the_chosen_tree_only() -> None:
    p = cache_aware()
    k = key("only on the candidate")
    d = p.select(URLS[1:], IDLE, k)
    assert d.url == "http://b"
    state = p.describe()
    assert state["http://b"]["tree_size"] == len(k) and state["http://a"]["tree_size"] == 0


def test_trees_survive_health_changes_and_follow_worker_stats() -> None:
    p = cache_aware(max_tree_size=1000)
    k = key("x" * 400)  # 32 chunks of 8 bytes, then 9 of 16: 41
    p.select(["http://a"], IDLE, k)
    p.on_worker_health("http://a", False)
    p.on_worker_health("http://a", True)
    assert p.trees["http://a"].match(k) == 41  # one dropped connection empties nothing
    stats = WorkerCacheStats(capacity_tokens=200, cached_blocks=5, prompt_tokens=100)
    p.on_worker_stats("http://a", stats, in_flight=0)  # the baseline
    p.select(["http://a"], IDLE, key("y" * 400))
    p.on_worker_stats("http://a", WorkerCacheStats(200, 5, 1100), in_flight=0)
    # 41 chunks per 1000 tokens: a 200-token cache holds about 8 chunks
    assert p.trees["http://a"].max_size == 8 and p.trees["http://a"].size == 8
    p.on_worker_stats("http://a", WorkerCacheStats(200, 5, 20), in_flight=1)  # restarted
    assert p.trees["http://a"].size == 0
    p.select(["http://a"], IDLE, k)
    p.on_worker_stats("http://a", WorkerCacheStats(200, 0, 30), in_flight=1)  # busy: keep
    assert p.trees["http://a"].size > 0
    p.on_worker_stats("http://a", WorkerCacheStats(200, 0, 30), in_flight=0)  # reset
    assert p.trees["http://a"].size == 0


def test_a_restarted_worker_comes_back_fresh_and_failed_dispatches_are_not_work() -> None:
    # first stats seen at start-up (counter 0): a restart must still be caught when the
    # counter goes back later (it compared with the first value seen, so it never was); the
    # restarted worker's old dispatches, and dispatches that failed, no longer make it look busy
    p = cache_aware(balance_window=64)
    a, b = "http://a", "http://b"
    p.on_worker_stats(a, WorkerCacheStats(10_000, 0, 0), in_flight=0)
    for i in range(6):
        p.select([a], IDLE, key(f"session {i} " * 20))
    p.on_worker_stats(a, WorkerCacheStats(10_000, 40, 5_000), in_flight=0)
    assert p.describe()[a]["recent"] == 6 and p.trees[a].size > 0
    p.on_worker_stats(a, WorkerCacheStats(10_000, 3, 200), in_flight=1)  # restarted, busy again
    assert p.trees[a].size == 0 and p.describe()[a]["recent"] == 0
    p.select([b], IDLE, key("one " * 20))
    p.select([b], IDLE, key("two " * 20))
    assert p.select([a, b], IDLE, key("a new prefix " * 20)).url == a  # fewest recent
    p.on_dispatch_failed(a)  # that one never reached it: retried elsewhere
    assert p.describe()[a]["recent"] == 0


def test_trees_trim_every_eviction_interval() -> None:
    now = [0.0]
    p = cache_aware(max_tree_size=5, eviction_interval=10, clock=lambda: now[0])
    p.select(["http://a"], IDLE, key("z" * 80))  # 10 chunks, above the bound until a trim
    assert p.trees["http://a"].size == 10
    now[0] = 11
    p.select(["http://b"], IDLE, key("w"))
    assert p.trees["http://a"].size == 5


def test_make_policy_and_validation() -> None:
    assert make_policy("cache_aware", URLS).name == "cache_aware"
    assert make_policy("least_load", URLS).name == "least_load"
    with pytest.raises(ValueError, match="policy"):
        make_policy("fastest", URLS)
    for bad, match in [({"cache_threshold": 1.5}, "cache_threshold"),
                       ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
                       ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
                       ({"balance_window": -1}, "balance_window"),
                       ({"eviction_interval": -1}, "eviction_interval")]:
        with pytest.raises(ValueError, match=match):
            cache_aware(**bad)
    with pytest.raises(ValueError, match="urls"):
        RoundRobinPolicy().select([], IDLE, key("x"))
