"""The prefix-hash policy: longest chunk-hash match per worker, else least load."""

from __future__ import annotations

import pytest

from prefixkv.router.health import WorkerCacheStats
from prefixkv.router.keys import completion_key
from prefixkv.router.policies import make_policy
from prefixkv.router.prefix_hash import PrefixHashPolicy

URLS = ["http://a", "http://b", "http://c"]
IDLE = dict.fromkeys(URLS, 0)


def key(text: str):
    return completion_key({"model": "m", "prompt": text}, 8)


def test_longest_match_wins_even_when_loaded() -> None:
    p = PrefixHashPolicy(URLS)
    doc = "D" * 200
    first = p.select(URLS, IDLE, key(doc))
    assert first.reason == "least_load"
    longer = p.select(URLS, {**IDLE, first.url: 1}, key(doc + "Q" * 100))
    assert longer.url == first.url and longer.reason == "prefix_hash"  # load does not count
    # a worker that saw a longer version of the prompt beats one that saw only the shared head
    p = PrefixHashPolicy(URLS)
    p.trees["http://a"].insert(key("S" * 200))
    p.trees["http://b"].insert(key("S" * 200 + "T" * 200))
    loads = {"http://a": 0, "http://b": 5, "http://c": 0}
    d = p.select(URLS, loads, key("S" * 200 + "T" * 200 + "x"))
    assert d.url == "http://b" and d.reason == "prefix_hash" and d.match_ratio > 0.9
    # no ratio threshold: a 200-byte match of a long prompt still decides
    d = p.select(URLS, IDLE, key("S" * 200 + "new" * 300))
    assert d.url in ("http://a", "http://b") and d.reason == "prefix_hash"


def test_matches_shorter_than_min_match_bytes_do_not_count() -> None:
    p = PrefixHashPolicy(URLS)  # 128 bytes, vLLM's chunk
    p.trees["http://a"].insert(key("S" * 100 + "one"))
    d = p.select(URLS, {"http://a": 1, "http://b": 0, "http://c": 0}, key("S" * 100 + "two"))
    assert d.reason == "least_load" and d.url != "http://a"
    q = PrefixHashPolicy(URLS, min_match_bytes=0)
    q.trees["http://a"].insert(key("S" * 100 + "one"))
    assert q.select(URLS, {"http://a": 1, "http://b": 0, "http://c": 0},
                    key("S" * 100 + "two")).url == "http://a"
    ids = completion_key({"model": "m", "prompt": list(range(40))}, 8)
    p.trees["http://b"].insert(ids)  # 40 ids count as 160 bytes
    assert p.select(URLS, IDLE, ids).url == "http://b"
    with pytest.raises(ValueError, match="min_match_bytes"):
        PrefixHashPolicy(URLS, min_match_bytes=-1)


def test_ties_go_to_least_load_and_no_match_rotates() -> None:
    p = PrefixHashPolicy(URLS, min_match_bytes=0)
    for u in URLS:
        p.trees[u].insert(key("same prompt"))
    assert p.select(URLS, {"http://a": 2, "http://b": 0, "http://c": 1},
                    key("same prompt")).url == "http://b"
    q = PrefixHashPolicy(URLS)
    picks = {q.select(URLS, IDLE, key(f"unique {i}" * 5)).url for i in range(3)}
    assert picks == set(URLS)


def test_follows_sessions_and_candidates() -> None:
    p = PrefixHashPolicy(URLS, min_match_bytes=0)
    home = p.select(URLS, IDLE, key("session one turn 1")).url
    assert p.select(URLS, IDLE, key("session one turn 1 turn 2")).url == home
    rest = [u for u in URLS if u != home]
    d = p.select(rest, IDLE, key("session one turn 1 turn 2 turn 3"))
    assert d.url in rest and d.reason == "least_load"


def test_bounded_tries_and_stats_reset() -> None:
    p = PrefixHashPolicy(URLS, max_tree_size=10)
    for i in range(20):
        p.select(["http://a"], IDLE, key(f"prompt {i} " * 4))
    assert p.trees["http://a"].size <= 10
    assert p.describe()["http://a"]["tree_bound"] == 10
    p.on_worker_stats("http://a", WorkerCacheStats(1000, 0, 50), in_flight=1)
    assert p.trees["http://a"].size > 0  # requests in flight: not a reset
    p.on_worker_health("http://a", False)
    assert p.trees["http://a"].size > 0
    p.on_worker_stats("http://a", WorkerCacheStats(1000, 0, 50), in_flight=0)
    assert p.trees["http://a"].size == 0
    assert isinstance(make_policy("prefix_hash", URLS, max_tree_size=7), PrefixHashPolicy)
