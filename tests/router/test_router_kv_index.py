"""The exact index, the event stream's sequence handling and the precise policy's choices,
fed with real encoded batches (a real publisher for replay), without workers."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

import zmq
import zmq.asyncio

from prefixkv.engine.kv_events import KVEventSink
from prefixkv.engine.kv_events_zmq import ZmqEventPublisher
from prefixkv.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    block_hashes,
)
from prefixkv.router.cache_aware import CacheAwarePolicy
from prefixkv.router.config import RouterConfig
from prefixkv.router.keys import text_key
from prefixkv.router.kv_index import ExactIndex
from prefixkv.router.kv_stream import EventSource, EventStream, parse_sources
from prefixkv.router.precise import PrecisePolicy, TokenRouteKey

A, B = "http://a:1", "http://b:1"
ENC = msgspec.msgpack.Encoder()


def stored(tokens: list[int], bs: int = 4) -> KVEventBatch:
    hashes = block_hashes(tokens, bs)
    return KVEventBatch(0.0, [BlockStored(hashes, None, tokens, bs, None, "GPU", None)], 0)


def test_index_tracks_stores_removals_and_clears() -> None:
    index = ExactIndex([A, B])
    toks = list(range(16))
    hashes = block_hashes(toks, 4)
    index.apply(A, stored(toks))
    index.apply(B, stored(toks[:8]))
    assert index.match(hashes, [A, B]) == {A: 4, B: 2}
    index.apply(A, KVEventBatch(0.0, [BlockRemoved(hashes[2:3], "GPU")]))
    assert index.match(hashes, [A, B]) == {A: 2, B: 2}  # a hole ends the prefix
    index.apply(B, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert index.match(hashes, [A, B]) == {A: 2, B: 0}
    assert index.workers[B].complete and index.describe(A)["exact_blocks"] == 3
    index.reset(A, complete=False, live=False)
    assert index.holders == {} and not index.workers[A].live


def test_stream_gaps_restarts_and_garbage() -> None:
    async def go() -> None:
        index = ExactIndex([A])
        ctx = zmq.asyncio.Context()
        stream = EventStream(A, EventSource("tcp://127.0.0.1:1"), index, ctx)
        toks = list(range(8))
        await stream.receive(0, ENC.encode(stored(toks)))
        w = index.workers[A]
        assert w.live and w.complete and len(w.blocks) == 2
        await stream.receive(3, ENC.encode(stored(toks[:4])))  # 1 and 2 lost, no replay
        assert w.gaps == 1 and not w.complete and len(w.blocks) == 1
        await stream.receive(0, ENC.encode(stored(toks)))  # the worker restarted
        assert w.restarts == 1 and w.complete and len(w.blocks) == 2
        await stream.receive(1, b"\xc1 not msgpack")
        assert w.gaps == 2 and not w.blocks
        ctx.destroy(linger=0)

    asyncio.run(go())


def test_stream_fills_a_gap_from_the_replay_socket() -> None:
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": '
                                  '"tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}')
    pub = ZmqEventPublisher(config)
    sink = KVEventSink(4, pub)
    try:
        for i in range(3):  # three batches, published before anyone subscribed
            sink.stored([i], i - 1 if i else None, list(range(4 * i, 4 * i + 4)), None)
            deadline = time.monotonic() + 10
            while sink.published <= i and time.monotonic() < deadline:
                time.sleep(0.01)
        assert pub.replay_endpoint is not None

        async def go() -> ExactIndex:
            index = ExactIndex([A])
            ctx = zmq.asyncio.Context()
            stream = EventStream(A, EventSource(pub.endpoint, pub.replay_endpoint), index, ctx)
            await stream.receive(3, ENC.encode(KVEventBatch(0.0, [])))  # joined late
            ctx.destroy(linger=0)
            return index

        index = asyncio.run(go())
        w = index.workers[A]
        assert w.complete and w.gaps == 0
        assert index.match(block_hashes(list(range(12)), 4), [A]) == {A: 3}
    finally:
        sink.close()


def policy(**kw: object) -> PrecisePolicy:
    return PrecisePolicy([A, B], CacheAwarePolicy([A, B], eviction_interval=0), **kw)  # type: ignore[arg-type]


def key(tokens: list[int], text: str = "t") -> TokenRouteKey:
    k = text_key(text, None)
    return TokenRouteKey(k.namespace, k.chunks, k.size, k.unit, tuple(tokens))


def test_precise_routes_to_the_real_holder_over_the_approximate_guess() -> None:
    p = policy()
    toks = list(range(32))
    # the approximate tree believes B holds the prompt (it was routed there) ...
    p.fallback.select([B], {}, key(toks, "same text"))
    # ... but B evicted it and A holds it, per their events
    p.index.apply(A, stored(toks))
    p.index.apply(B, KVEventBatch(0.0, []))
    d = p.select([A, B], {A: 0, B: 0}, key(toks, "same text"))
    assert (d.url, d.reason, d.match_ratio) == (A, "exact_hit", 1.0)
    # an incomplete worker: the larger of its exact match and its tree's guess
    p.index.reset(B, complete=False)
    d = p.select([A, B], {A: 1, B: 0}, key(toks, "same text"))
    assert d.url == B and d.reason == "cache_hit"
    # load guard: imbalanced loads send it to the least loaded whatever the match
    assert p.select([A, B], {A: 100, B: 0}, key(toks)).reason == "balance"


def test_precise_falls_back_to_cache_aware_without_events_or_tokens() -> None:
    p = policy()
    d = p.select([A, B], {}, key(list(range(32))))  # nobody published
    assert d.reason == "least_load"
    plain = text_key("no tokens", None)
    p.index.apply(A, stored(list(range(8))))
    assert p.select([A, B], {}, plain).reason in ("least_load", "cache_hit")
    assert p.describe()[A]["events_live"] == 1


def test_kv_events_settings_are_checked() -> None:
    urls = [A, B]
    assert parse_sources(urls, ["auto"]) == {}
    assert parse_sources(urls, ["none", "tcp://h:1|tcp://h:2"], "t") == {
        A: None, B: EventSource("tcp://h:1", "tcp://h:2", "t")}
    assert parse_sources(urls, ["bind:tcp://*:7|tcp://h:2", "bind:ipc:///tmp/e"]) == {
        A: EventSource("tcp://*:7", "tcp://h:2", "", bind=True),
        B: EventSource("ipc:///tmp/e", None, "", bind=True)}
    for bad in (["auto", "auto", "auto"], ["http://h:1", "none"], ["tcp://h:1"],
                ["bind:h:1", "none"]):
        with pytest.raises(ValueError, match="kv_events"):
            parse_sources(urls, bad)
    with pytest.raises(ValueError, match="kv_events"):
        RouterConfig(worker_urls=(A, B), policy="precise", kv_events=("x", "y"))


def test_rehash_maps_a_foreign_workers_hashes_onto_prefixkv_hashes() -> None:
    # a vLLM worker: its own hashes (bytes here, as newer vLLM sends), same tokens
    index = ExactIndex([A], rehash=True)
    toks = list(range(12))
    theirs: list[int | bytes] = [b"h0", b"h1"]
    index.apply(A, KVEventBatch(0.0, [BlockStored(theirs, None, toks[:8], 4, None, "GPU", None)]))
    index.apply(A, KVEventBatch(0.0, [BlockStored([b"h2"], b"h1", toks[8:], 4, None, "GPU", None)]))
    ours = block_hashes(toks, 4)
    assert index.match(ours, [A]) == {A: 3}
    index.apply(A, KVEventBatch(0.0, [BlockRemoved([b"h1"], "GPU")]))
    assert index.match(ours, [A]) == {A: 1}
    orphan = BlockStored([b"x"], b"never-seen", toks[:4], 4, None, "GPU", None)
    index.apply(A, KVEventBatch(0.0, [orphan]))
    assert len(index.workers[A].blocks) == 2  # skipped: its parent is unknown
    # the same batches decoded from the wire (bytes hashes survive the schema)
    wire = msgspec.msgpack.decode(ENC.encode(KVEventBatch(0.0, [orphan])), type=KVEventBatch)
    assert wire.events[0].block_hashes == [b"x"]


def test_stats_showing_a_restart_forget_the_workers_blocks() -> None:
    from prefixkv.router.health import WorkerCacheStats

    p = policy()
    p.index.apply(A, stored(list(range(8))))
    p.on_worker_stats(A, WorkerCacheStats(1024, 2, 500), 0)
    assert len(p.index.workers[A].blocks) == 2
    p.on_worker_stats(A, WorkerCacheStats(1024, 0, 10), 0)  # its prompt counter went back
    w = p.index.workers[A]
    assert not w.blocks and not w.live and w.epoch == 1
    p.on_worker_health(A, False)  # leaving the rotation forgets nothing more
    assert p.describe()[A]["events_live"] == 0


def test_pending_prompts_count_until_the_worker_is_cleared() -> None:
    now = [0.0]
    p = PrecisePolicy([A, B], CacheAwarePolicy([A, B], eviction_interval=0),
                      clock=lambda: now[0])
    for u in (A, B):
        p.index.apply(u, stored([999] * 4))  # both live, block size 4, nothing shared
    toks = list(range(32))
    first = p.select([A, B], {}, key(toks, "a"))
    # sent there a moment ago, not yet announced: the same prompt follows it
    again = p.select([A, B], {first.url: 1}, key(toks, "b"))
    assert (again.url, again.reason) == (first.url, "exact_hit")
    p.index.apply(first.url, KVEventBatch(0.0, [AllBlocksCleared()]))
    p.index.apply(first.url, stored([999] * 4))
    assert p.exact_matches([A, B], key(toks))[first.url] == 0  # cleared: no longer counted
    now[0] = 10.0
    assert p._pending_match(first.url, block_hashes(toks, 4), now[0]) == 0


def test_matches_within_a_block_of_the_best_are_ties_the_load_breaks() -> None:
    p = policy(pending_ttl=0)  # prompts sent are not counted as pending here
    toks = list(range(40))  # 10 blocks of 4
    p.index.apply(A, stored(toks[:24]))  # A holds 6 blocks, B 5: one block apart
    p.index.apply(B, stored(toks[:20]))
    d = p.select([A, B], {A: 2, B: 0}, key(toks, "x"))
    assert (d.url, d.reason, d.match_ratio) == (B, "exact_hit", 0.5)
    assert p.select([A, B], {A: 0, B: 0}, key(toks, "y")).url == A  # equal loads: the longer
    strict = policy(tie_blocks=0, pending_ttl=0)
    strict.index.apply(A, stored(toks[:24]))
    strict.index.apply(B, stored(toks[:20]))
    assert strict.select([A, B], {A: 2, B: 0}, key(toks, "z")).url == A
    # two blocks apart is no tie
    p.index.apply(B, KVEventBatch(0.0, [AllBlocksCleared()]))
    p.index.apply(B, stored(toks[:16]))
    assert p.select([A, B], {A: 2, B: 0}, key(toks, "w")).url == A
