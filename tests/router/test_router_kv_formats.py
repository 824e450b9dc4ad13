"""KV event batches as the fleet publishes them, read by the router without any setting.

The fixtures under ``fixtures/`` are msgpack payloads built by the structs below, which mirror
the publishers' own declarations field for field (vLLM 0.32's ``vllm/distributed/kv_events.py``:
an array-like batch of events encoded as maps tagged ``type``; newer vLLM's map-encoded batch;
vLLM's older all-array layout; SGLang's ``srt/disaggregation/kv_events.py``: array events with
fewer fields, a two- or three-element batch). ``python tests/router/test_router_kv_formats.py``
writes them again; a test checks the committed bytes still equal what the structs encode.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from prefixkv.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hashes,
    decode_batch,
    encode_batch,
)
from prefixkv.router.cache_aware import CacheAwarePolicy
from prefixkv.router.keys import text_key
from prefixkv.router.kv_index import ExactIndex, TierWeights, tier_of
from prefixkv.router.kv_stream import (
    EventSource,
    EventStream,
    SharedEventStream,
    parse_sources,
    topic_worker,
)
from prefixkv.router.metrics import RouterMetrics
from prefixkv.router.precise import PrecisePolicy, TokenRouteKey
from prefixkv.router.workers import WorkerRegistry
from vllm_events import (
    OldRemoved,
    OldStored,
    SgBatch,
    SgCleared,
    SgRemoved,
    SgStored,
    VBatch,
    VCleared,
    VMapBatch,
    VRemoved,
    VStored,
)

FIXTURES = Path(__file__).parent / "fixtures"
A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
TOKENS = list(range(100, 148))  # three blocks of 16
VLLM_HASHES = [0x1A2B3C4D5E6F7081, 0x2B3C4D5E6F708192, 0x3C4D5E6F708192A3]


class SgDpBatch(SgBatch):
    attn_dp_rank: int | None = None


def payloads() -> dict[str, bytes]:
    """Every fixture's bytes, from the publishers' structs."""
    enc = msgspec.msgpack.encode
    h = VLLM_HASHES
    return {
        # a prompt's first block in the pool, then two more (a hybrid model's group 0), a CPU
        # copy of the first two (vLLM's offloading connector), the pool dropping its first
        "vllm-0.32-map.msgpack": enc(VBatch(1764300000.25, [
            VStored(h[:1], None, TOKENS[:16], 16, None, "GPU", None),
            VStored(h[1:], h[0], TOKENS[16:], 16, None, "GPU", None, [None, None], 0,
                    "full_attention"),
            VStored(h[:2], None, TOKENS[:32], 16, None, "CPU", None),
            VRemoved(h[:1], "GPU"),
        ], 0)),
        # a LoRA adapter's and a salted tenant's blocks: other namespaces
        "vllm-0.32-lora-salt.msgpack": enc(VBatch(1764300001.5, [
            VStored([0x77], None, TOKENS[:16], 16, 1, "GPU", "sql-lora", [("sql-lora",)]),
            VStored([0x78], None, TOKENS[:16], 16, None, "GPU", None, [("tenant-a",)]),
        ], 0)),
        "vllm-0.32-cleared.msgpack": enc(VBatch(1764300002.0, [VCleared()], 0)),
        # newer vLLM: map batch, bytes hashes
        "vllm-map-batch-bytes.msgpack": enc(VMapBatch(1764300003.0, [
            VStored([b"\x01" * 32], None, TOKENS[:16], 16, None, "GPU", None),
        ], 1)),
        "vllm-array.msgpack": enc(VBatch(1764300004.0, [
            OldStored(h[:2], None, TOKENS[:32], 16, None, "GPU"),
            OldRemoved(h[1:2], "GPU"),
        ], 0)),
        "sglang.msgpack": enc(SgBatch(1764300005.0, [
            SgStored([11, 12], None, TOKENS[:32], 16, None),
            SgStored([13], 12, TOKENS[32:], 16, None),
            SgRemoved([13]),
        ])),
        "sglang-dp.msgpack": enc(SgDpBatch(1764300006.0, [SgCleared()], 1)),
    }


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def test_the_committed_fixtures_are_what_the_publishers_structs_encode() -> None:
    for name, data in payloads().items():
        assert fixture(name) == data, name


def test_vllm_032_map_events_keep_every_field() -> None:
    batch = decode_batch(fixture("vllm-0.32-map.msgpack"))
    assert batch.data_parallel_rank == 0 and batch.ts == 1764300000.25
    first, second, cpu, removed = batch.events
    assert isinstance(first, BlockStored) and first.medium == "GPU" and first.lora_name is None
    assert isinstance(second, BlockStored) and second.parent_block_hash == VLLM_HASHES[0]
    assert second.extra_keys == [None, None] and second.group_idx == 0
    assert second.kv_cache_spec_kind == "full_attention"
    assert isinstance(cpu, BlockStored) and cpu.medium == "CPU"
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    lora, salted = decode_batch(fixture("vllm-0.32-lora-salt.msgpack")).events
    assert isinstance(lora, BlockStored) and lora.lora_name == "sql-lora" and lora.lora_id == 1
    assert lora.extra_keys == [["sql-lora"]]
    assert isinstance(salted, BlockStored) and salted.extra_keys == [["tenant-a"]]
    assert isinstance(decode_batch(fixture("vllm-0.32-cleared.msgpack")).events[0],
                      AllBlocksCleared)
    newer = decode_batch(fixture("vllm-map-batch-bytes.msgpack"))
    assert newer.data_parallel_rank == 1 and newer.events[0].block_hashes == [b"\x01" * 32]


def test_the_old_array_layout_and_sglangs_are_read_too() -> None:
    stored, removed = decode_batch(fixture("vllm-array.msgpack")).events
    assert isinstance(stored, BlockStored) and stored.medium == "GPU" and stored.lora_name is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == VLLM_HASHES[1:2]
    sg = decode_batch(fixture("sglang.msgpack"))
    assert sg.data_parallel_rank is None
    assert [type(e).__name__ for e in sg.events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert sg.events[0].medium is None and sg.events[2].medium is None  # type: ignore[union-attr]
    dp = decode_batch(fixture("sglang-dp.msgpack"))
    assert dp.data_parallel_rank == 1 and isinstance(dp.events[0], AllBlocksCleared)


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"ts": 1.0}),
                                     msgspec.msgpack.encode([1.0, [["BlockMoved", [1]]]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
                                     msgspec.msgpack.encode([1.0, [7]]),
                                     msgspec.msgpack.encode(["x", []])])
def test_anything_else_is_a_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_prefixkv_encodes_both_layouts_and_reads_them_back() -> None:
    batch = KVEventBatch(2.0, [BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None),
                               BlockRemoved([1], "GPU"), AllBlocksCleared()], 0)
    for encoding in ("map", "array"):
        assert decode_batch(encode_batch(batch, encoding)) == batch
    as_map = msgspec.msgpack.decode(encode_batch(batch))
    assert as_map[1][0]["type"] == "BlockStored" and as_map[1][0]["lora_name"] is None
    with pytest.raises(ValueError, match="encoding"):
        encode_batch(batch, "json")
    # byte for byte what vLLM 0.32's structs encode, and what its older structs encoded
    theirs = VBatch(2.0, [VStored([1, 2], None, list(range(8)), 4, None, "GPU", None),
                          VRemoved([1], "GPU"), VCleared()], 0)
    assert encode_batch(batch) == msgspec.msgpack.encode(theirs)
    old = VBatch(2.0, [OldStored([1, 2], None, list(range(8)), 4, None, "GPU"),
                       OldRemoved([1], "GPU"), SgCleared()], 0)
    assert encode_batch(batch, "array") == msgspec.msgpack.encode(old)


def test_vllm_and_sglang_batches_route_exactly_when_rehashed() -> None:
    """The router derives prefixkv hashes from the fixtures' tokens: the prompt matches."""
    index = ExactIndex([A, B], rehash=True)
    index.apply(A, decode_batch(fixture("vllm-0.32-map.msgpack")))
    index.apply(B, decode_batch(fixture("sglang.msgpack")))
    ours = block_hashes(TOKENS, 16)
    got = index.match(ours, [A, B])
    # A: block 0 only on CPU now (0.8), block 1 in the pool and on CPU (1.0), block 2 pool
    assert got[A] == pytest.approx(0.8 + 1.0 + 1.0)
    assert got[B] == 2.0  # SGLang removed its third block
    # LoRA and salted blocks are other namespaces: never matched as the base model's
    index.apply(B, decode_batch(fixture("sglang-dp.msgpack")))
    index.apply(B, decode_batch(fixture("vllm-0.32-lora-salt.msgpack")))
    assert index.match(ours, [B])[B] == 0
    index.apply(A, decode_batch(fixture("vllm-0.32-cleared.msgpack")))
    assert index.match(ours, [A])[A] == 0 and index.workers[A].complete


def test_tiers_are_weighted_and_removed_one_at_a_time() -> None:
    assert [tier_of(m) for m in (None, "GPU", "cpu", "DISK", "valkey")] == \
        ["pool", "pool", "host", "disk", "remote"]
    hashes = block_hashes(list(range(32)), 8)
    index = ExactIndex([A, B], weights=TierWeights.parse("host=0.5,disk=0.2"))
    tokens = list(range(32))
    index.apply(A, KVEventBatch(0.0, [BlockStored(hashes, None, tokens, 8, None, "DISK", None)]))
    index.apply(B, KVEventBatch(0.0, [BlockStored(hashes, None, tokens, 8, None, "CPU", None)]))
    assert index.match(hashes, [A, B]) == {A: pytest.approx(0.8), B: 2.0}
    index.apply(A, KVEventBatch(0.0, [BlockStored(hashes[:2], None, tokens[:16], 8, None,
                                                  "GPU", None)]))
    assert index.match(hashes, [A])[A] == pytest.approx(2.4)
    index.apply(A, KVEventBatch(0.0, [BlockRemoved(hashes, "GPU")]))  # the disk copies stay
    assert index.match(hashes, [A])[A] == pytest.approx(0.8)
    index.apply(A, KVEventBatch(0.0, [BlockRemoved(hashes, "DISK")]))
    assert index.match(hashes, [A])[A] == 0 and A not in index.holders.get(hashes[0], set())
    assert TierWeights.parse(None) == TierWeights(1.0, 0.8, 0.25, 0.25)
    for bad in ("gpu=1", "host=2", "host", "disk=x"):
        with pytest.raises(ValueError, match="kv_tier_weights"):
            TierWeights.parse(bad)


def test_precise_prefers_the_pool_holder_then_any_tier_over_nothing() -> None:
    """A worker with the prompt in its pool beats one with it on disk, which beats one with
    nothing; the ratio is the tier-weighted share (disk 0.25 by default)."""
    C = "http://127.0.0.1:8003"
    urls = [A, B, C]
    p = PrecisePolicy(urls, CacheAwarePolicy(urls, eviction_interval=0), cache_threshold=0.2)
    toks = list(range(64))
    k = text_key("t", None)
    key = TokenRouteKey(k.namespace, k.chunks, k.size, k.unit, tuple(toks))
    hashes = block_hashes(toks, 16)
    p.index.apply(A, KVEventBatch(0.0, [BlockStored(hashes, None, toks, 16, None, "DISK", None)]))
    p.index.apply(B, KVEventBatch(0.0, [BlockStored(hashes, None, toks, 16, None, "GPU", None)]))
    p.index.apply(C, KVEventBatch(0.0, []))
    d = p.select(urls, {A: 0, B: 0, C: 0}, key)
    assert (d.url, d.reason, d.match_ratio) == (B, "exact_hit", 1.0)
    d = p.select([A, C], {A: 0, C: 0}, key)
    assert (d.url, d.reason, d.match_ratio) == (A, "exact_hit", 0.25)


def test_an_unreadable_stream_is_counted_warned_once_and_shown_in_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over a real PUB/SUB pair: undecodable batches count per worker with one warning; the
    next readable batch is applied; /metrics shows both counters."""

    async def scenario() -> ExactIndex:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)  # a PUB that hears the subscription arrive
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        index = ExactIndex([A], rehash=True)
        stream = EventStream(A, EventSource(f"tcp://127.0.0.1:{port}"), index, ctx)
        task = asyncio.create_task(stream.run())
        try:
            assert (await asyncio.wait_for(pub.recv(), 30))[:1] == b"\x01"  # subscribed
            frames = [b"not msgpack", msgspec.msgpack.encode([1.0, [["BlockMoved"]]]),
                      fixture("vllm-0.32-map.msgpack")]
            for seq, payload in enumerate(frames):
                await pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
            for _ in range(100):
                if index.workers[A].batches:
                    break
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
            ctx.term()
        return index

    with caplog.at_level(logging.WARNING, logger="prefixkv.router"):
        index = asyncio.run(scenario())
    w = index.workers[A]
    assert (w.undecodable, w.batches) == (2, 1)
    warned = [r for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(warned) == 1 and A in warned[0].getMessage()
    text = RouterMetrics().render(WorkerRegistry([A]), {A: index.describe(A)}).decode()
    assert f'prefixkv:router_kv_event_undecodable{{worker="{A}"}} 2.0' in text
    assert f'prefixkv:router_kv_event_batches{{worker="{A}"}} 1.0' in text


def test_llm_d_topics_name_the_worker() -> None:
    urls = [A, B, "http://10.0.0.9:8000"]
    assert topic_worker(b"kv@127.0.0.1:8002@meta-llama/Llama-3.1-8B", urls) == B
    assert topic_worker(b"kv@10.0.0.9:5557@m", urls) == "http://10.0.0.9:8000"  # host alone
    assert topic_worker(b"kv@127.0.0.1:9999@m", urls) is None  # two workers on that host
    assert topic_worker(b"other", urls) is None
    sources = parse_sources([A, B], ["bind:tcp://127.0.0.1:5557"])
    assert all(s is not None and s.shared and s.bind for s in sources.values())
    with pytest.raises(ValueError, match="bind:"):
        parse_sources([A, B], ["tcp://127.0.0.1:5557"])


def test_one_bound_socket_serves_workers_publishing_under_llm_d_topics() -> None:
    """Two publishers connect to the router's one bound socket (vLLM's connect form, as llm-d
    deploys it); each batch lands in the index of the worker its topic names."""

    async def scenario() -> ExactIndex:
        ctx = zmq.asyncio.Context()
        probe = ctx.socket(zmq.PUB)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)
        endpoint = f"tcp://127.0.0.1:{port}"
        index = ExactIndex([A, B])
        source = EventSource(endpoint, None, "", True, True)
        streams = {u: EventStream(u, source, index, ctx) for u in (A, B)}
        task = asyncio.create_task(SharedEventStream(source, streams, ctx).run())
        pubs = []
        try:
            await asyncio.sleep(0.2)
            for url, prompt in ((A, list(range(16))), (B, list(range(50, 66)))):
                pub = ctx.socket(zmq.XPUB)  # hears the router's subscription arrive
                pub.connect(endpoint)
                pubs.append((pub, url, prompt))
            for pub, _, _ in pubs:
                assert (await asyncio.wait_for(pub.recv(), 30))[:1] == b"\x01"
            for pub, url, prompt in pubs:
                batch = KVEventBatch(0.0, [BlockStored(block_hashes(prompt, 8), None, prompt, 8,
                                                       None, "GPU", None)], 0)
                topic = f"kv@127.0.0.1:{url.rsplit(':', 1)[1]}@demo".encode()
                await pub.send_multipart((topic, (0).to_bytes(8, "big"), encode_batch(batch)))
            await pubs[0][0].send_multipart((b"kv@10.9.9.9:1@demo", (0).to_bytes(8, "big"),
                                             b"\x90"))
            for _ in range(100):
                if all(index.workers[u].batches for u in (A, B)):
                    break
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for pub, _, _ in pubs:
                pub.close(linger=0)
            ctx.term()
        return index

    index = asyncio.run(scenario())
    assert index.match(block_hashes(list(range(16)), 8), [A, B]) == {A: 2.0, B: 0.0}
    assert index.match(block_hashes(list(range(50, 66)), 8), [A, B]) == {A: 0.0, B: 2.0}
    assert index.workers[A].complete and index.workers[B].complete


if __name__ == "__main__":  # write the fixtures again
    FIXTURES.mkdir(exist_ok=True)
    for name, data in payloads().items():
        (FIXTURES / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes", file=sys.stderr)
