"""Consistent hashing with bounded loads: ring placement, the load bound, overflow."""

from __future__ import annotations

import pytest

from prefixkv.router.chwbl import ConsistentHashPolicy, HashRing
from prefixkv.router.keys import completion_key
from prefixkv.router.policies import make_policy

URLS = [f"http://w{i}" for i in range(4)]
KEYS = [completion_key({"model": "m", "prompt": f"user {i} " + "x" * 300}, 16)
        for i in range(400)]


def owners(policy: ConsistentHashPolicy, urls: list[str]) -> list[str]:
    idle = dict.fromkeys(urls, 0)
    return [policy.select(urls, idle, k).url for k in KEYS]


def test_idle_placement_is_deterministic_and_spread() -> None:
    a = owners(ConsistentHashPolicy(URLS), URLS)
    assert a == owners(ConsistentHashPolicy(URLS), URLS)
    counts = [a.count(u) for u in URLS]
    assert min(counts) > 50, counts  # 100 virtual nodes each: no worker starved
    assert {ConsistentHashPolicy(URLS).select(URLS, dict.fromkeys(URLS, 0), k).reason
            for k in KEYS[:20]} == {"hash"}


def test_removing_a_worker_moves_only_its_keys() -> None:
    p = ConsistentHashPolicy(URLS)
    before = owners(p, URLS)
    after = owners(p, URLS[:3])  # w3 out of rotation (same ring)
    for b, a in zip(before, after, strict=True):
        assert a == b or b == URLS[3]
    assert sum(b == URLS[3] for b in before) > 0


def test_adding_a_worker_takes_only_its_share() -> None:
    before = owners(ConsistentHashPolicy(URLS[:3]), URLS[:3])
    after = owners(ConsistentHashPolicy(URLS), URLS)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if a != b]
    assert moved and all(a == URLS[3] for _, a in moved)
    assert len(moved) < len(KEYS) / 2


def test_same_prefix_same_worker_beyond_hashed_prefix_ignored() -> None:
    p = ConsistentHashPolicy(URLS, prefix_chunks=4)  # first 64 bytes
    idle = dict.fromkeys(URLS, 0)
    a = completion_key({"model": "m", "prompt": "S" * 64 + "one"}, 16)
    b = completion_key({"model": "m", "prompt": "S" * 64 + "two, entirely different"}, 16)
    assert p.select(URLS, idle, a).url == p.select(URLS, idle, b).url
    other_model = completion_key({"model": "n", "prompt": "S" * 64 + "one"}, 16)
    assert p.point(other_model) != p.point(a)


def test_bound_respected_and_overflow_walks_the_ring() -> None:
    p = ConsistentHashPolicy(URLS, load_factor=1.25)
    k = KEYS[0]
    home = p.select(URLS, dict.fromkeys(URLS, 0), k).url
    ring_order = list(p.ring.walk(p.point(k)))
    assert ring_order[0] == home and sorted(ring_order) == sorted(URLS)
    # total 8 in flight, bound = ceil(1.25 * 9 / 4) = 3: home at 3 is over it
    loads = {home: 3, ring_order[1]: 3, ring_order[2]: 1, ring_order[3]: 1}
    assert p.bound(sum(loads.values()), 4) == 3
    d = p.select(URLS, loads, k)
    assert d.url == ring_order[2] and d.reason == "overflow"
    # every decision under a skewed stream keeps each worker within the bound
    loads = dict.fromkeys(URLS, 0)
    for _ in range(40):
        d = p.select(URLS, loads, k)  # the same key over and over: a hot prefix
        loads[d.url] += 1
        assert loads[d.url] <= p.bound(sum(loads.values()) - 1, 4)
    assert max(loads.values()) <= 1.25 * 40 / 4 + 1


def test_validation_and_registry() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        ConsistentHashPolicy(URLS, load_factor=0.9)
    with pytest.raises(ValueError, match="prefix_chunks"):
        ConsistentHashPolicy(URLS, prefix_chunks=0)
    with pytest.raises(ValueError, match="replicas"):
        HashRing(URLS, replicas=0)
    with pytest.raises(ValueError, match="urls"):
        HashRing([])
    with pytest.raises(ValueError, match="urls"):
        ConsistentHashPolicy(URLS).select([], {}, KEYS[0])
    p = make_policy("consistent_hash", URLS, load_factor=2.0, hash_prefix_chunks=3)
    assert isinstance(p, ConsistentHashPolicy) and p.load_factor == 2.0
    assert p.prefix_chunks == 3 and p.describe() == {}


def test_route_cli_flags_reach_the_config() -> None:
    import argparse

    from prefixkv.cli.route import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["route", "--worker-urls", "http://a:1", "--policy",
                              "consistent_hash", "--load-factor", "2", "--hash-prefix-chunks",
                              "4", "--hash-replicas", "7", "--simulate-eviction",
                              "--capacity-tokens", "512"])
    assert (args.policy, args.load_factor, args.hash_prefix_chunks, args.hash_replicas,
            args.simulate_eviction, args.capacity_tokens) == ("consistent_hash", 2.0, 4, 7,
                                                              True, 512)
    with pytest.raises(SystemExit):
        parser.parse_args(["route", "--worker-urls", "http://a:1", "--policy", "chwbl"])
