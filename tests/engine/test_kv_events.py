"""KV events from a real engine (demo model) over a real ZMQ socket, decoded as vLLM decodes them.

The subscriber below declares vLLM 0.32's event types (``vllm/distributed/kv_events.py``: an
array-like batch of msgspec structs encoded as maps tagged ``type`` = the class name) on its own,
and the older array layout, so these tests check the wire format, not prefixkv's classes against
themselves.
"""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from prefixkv.engine import LLM, SamplingParams
from prefixkv.engine.kv_events import KVEventSink
from prefixkv.engine.kv_events_zmq import END_SEQ, ZmqEventPublisher
from prefixkv.wire.kv_events import KVEventBatch as OurBatch
from prefixkv.wire.kv_events import KVEventsConfig, block_hashes


from vllm_events import DECODER, OLD_DECODER, OldStored, VKVEventBatch  # vLLM's own schema
from vllm_events import VCleared as AllBlocksCleared
from vllm_events import VRemoved as BlockRemoved
from vllm_events import VStored as BlockStored
"""vLLM before its map encoding: each event an array ``[tag, field, ...]``."""
EVENTS = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
          '"replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}')


class Subscriber:
    """A SUB socket on the engine's endpoint collecting (seq, batch) pairs."""

    def __init__(self, endpoint: str, topic: bytes = b"kv") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher
        self.got: list[tuple[int, VKVEventBatch]] = []

    def drain(self, quiet: float = 0.4) -> list[Any]:
        """Events received until ``quiet`` seconds pass with none."""
        events: list[Any] = []
        while self.sock.poll(int(quiet * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            batch = DECODER.decode(payload)
            self.got.append((int.from_bytes(seq, "big"), batch))
            events.extend(batch.events)
        return events

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def make(demo_model: Any, **kwargs: Any) -> tuple[LLM, Subscriber]:
    llm = LLM(demo_model, kv_events_config=EVENTS, **kwargs)
    sink = llm.engine.kv.events
    assert sink is not None
    return llm, Subscriber(sink.publisher.endpoint)


def greedy(n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.mark.parametrize(("index", "block_size"), [("radix", 4), ("hash", 16)])
def test_stored_removed_cleared_follow_the_cache(demo_model: Any, index: str,
                                                 block_size: int) -> None:
    llm, sub = make(demo_model, index=index, block_size=block_size, num_kv_blocks=24)
    try:
        prompt = [(7 * i) % 200 + 3 for i in range(5 * block_size + 1)]
        llm.generate([prompt], greedy())
        stored = [e for e in sub.drain() if isinstance(e, BlockStored)]
        hashes = [h for e in stored for h in e.block_hashes]
        assert hashes[:5] == block_hashes(prompt, block_size)  # what a router computes
        assert stored[0].parent_block_hash is None and stored[0].token_ids[:block_size] == \
            prompt[:block_size]
        for a, b in itertools.pairwise(stored):  # one chain: each event continues the last
            assert b.parent_block_hash == a.block_hashes[-1]
        assert all(e.block_size == block_size and e.medium == "GPU" for e in stored)
        assert llm.engine.is_prefix_cached(prompt[: 5 * block_size])
        # other prompts fill the pool: the first prompt's blocks are evicted and announced
        for s in range(4):
            llm.generate([[(11 * i + s) % 200 + 3 for i in range(5 * block_size)]], greedy())
        removed = {h for e in sub.drain() if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert set(block_hashes(prompt, block_size)[:5]) & removed
        llm.engine.reset_prefix_cache()
        assert isinstance(sub.drain()[-1], AllBlocksCleared)
        seqs = [s for s, _ in sub.got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap in the numbering
    finally:
        llm.engine.close()
        sub.close()


def test_a_shared_prefix_is_announced_once_and_salted_prompts_hash_apart(
    demo_model: Any
) -> None:
    llm, sub = make(demo_model, block_size=4, num_kv_blocks=64)
    try:
        base = list(range(10, 30))
        llm.generate([base + [1, 2, 3, 4, 5]], greedy())
        llm.generate([base + [6, 7, 8, 9, 9]], greedy())
        stored = [h for e in sub.drain() if isinstance(e, BlockStored) for h in e.block_hashes]
        shared = block_hashes(base, 4)
        assert all(stored.count(h) == 1 for h in shared)
        llm.engine.add_request(base, greedy(), cache_salt="tenant-a")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        salted = [h for e in sub.drain() if isinstance(e, BlockStored) for h in e.block_hashes]
        assert salted[:5] == block_hashes(base, 4, ("tenant-a", None))
        assert not set(salted) & set(shared)
    finally:
        llm.engine.close()
        sub.close()


def test_a_salted_tenants_tokens_never_leave_the_worker(demo_model: Any) -> None:
    """Issue 40.7: any subscriber sees a salted request's block hashes (the router needs them)
    but neither its token ids nor its salt; an unsalted request's tokens are still published."""
    llm, sub = make(demo_model, block_size=4, num_kv_blocks=64)
    try:
        secret = [(13 * i) % 200 + 5 for i in range(21)]
        for salt in ("tenant-a", json_salt()):
            llm.engine.add_request(secret, greedy(), cache_salt=salt)
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
            stored = [e for e in sub.drain() if isinstance(e, BlockStored)]
            assert [h for e in stored for h in e.block_hashes][:5] == \
                block_hashes(secret, 4, (salt, None))
            assert all(e.token_ids == [] and not e.extra_keys for e in stored)
        raw = b"".join(msgspec.msgpack.encode(b) for _, b in sub.got)
        assert b"tenant-a" not in raw
        llm.generate([secret], greedy())  # the same prompt unsalted: its tokens are published
        open_ = [e for e in sub.drain() if isinstance(e, BlockStored)]
        assert open_[0].token_ids[:20] == secret[:20]
    finally:
        llm.engine.close()
        sub.close()


def test_the_host_tier_announces_what_it_keeps_and_drops_as_cpu(demo_model: Any) -> None:
    """Issue 42.2: a pool eviction the host tier keeps is a ``BlockStored`` on ``"CPU"`` (hashes
    only) beside the ``"GPU"`` removal; a host-tier eviction is a ``BlockRemoved`` on ``"CPU"``."""
    llm, sub = make(demo_model, block_size=4, num_kv_blocks=12, kv_offload_size=6)
    try:
        prompt = [(7 * i) % 200 + 3 for i in range(21)]
        ours = block_hashes(prompt, 4)
        llm.generate([prompt], greedy())
        sub.drain()
        for s in range(2):  # other prompts evict the first one's blocks from the pool
            llm.generate([[(11 * i + s) % 200 + 3 for i in range(21)]], greedy())
        events = sub.drain()
        to_cpu = {h for e in events if isinstance(e, BlockStored) and e.medium == "CPU"
                  for h in e.block_hashes}
        off_gpu = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"
                   for h in e.block_hashes}
        assert set(ours) & to_cpu and set(ours) & off_gpu
        assert all(e.token_ids == [] for e in events
                   if isinstance(e, BlockStored) and e.medium == "CPU")
        for s in range(4):  # more evictions overflow the 6-block host tier: it drops some
            llm.generate([[(17 * i + s) % 200 + 3 for i in range(21)]], greedy())
        events = sub.drain()
        off_cpu = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"
                   for h in e.block_hashes}
        assert set(ours) & to_cpu & off_cpu
        host = llm.engine.kv.tiers.host  # type: ignore[union-attr]
        assert host is not None and host.on_drop is not None
    finally:
        llm.engine.close()
        sub.close()


def test_the_disk_tier_announces_what_its_writer_wrote_and_dropped(demo_model: Any,
                                                                   tmp_path: Any) -> None:
    """Issue 42.2: a block the disk tier wrote is a ``BlockStored`` on ``"DISK"`` (hashes
    only); one it evicted (capacity) or cleared is a ``BlockRemoved`` on ``"DISK"``."""
    llm, sub = make(demo_model, block_size=4, num_kv_blocks=64, kv_disk_dir=str(tmp_path),
                    kv_disk_size=8)
    tiers = llm.engine.kv.tiers
    assert tiers is not None
    try:
        prompt = [(5 * i) % 200 + 3 for i in range(21)]
        ours = block_hashes(prompt, 4)
        llm.generate([prompt], greedy())
        assert tiers.flush()
        events = sub.drain()
        on_disk = {h for e in events if isinstance(e, BlockStored) and e.medium == "DISK"
                   for h in e.block_hashes}
        assert set(ours) <= on_disk
        assert all(e.token_ids == [] for e in events
                   if isinstance(e, BlockStored) and e.medium == "DISK")
        for s in range(2):  # more prompts overflow the 8-block disk tier: it evicts some
            llm.generate([[(9 * i + s) % 200 + 3 for i in range(21)]], greedy())
        assert tiers.flush()
        gone = {h for e in sub.drain() if isinstance(e, BlockRemoved) and e.medium == "DISK"
                for h in e.block_hashes}
        assert set(ours) & gone
        tiers.clear(["disk"])
        cleared = {h for e in sub.drain() if isinstance(e, BlockRemoved) and e.medium == "DISK"
                   for h in e.block_hashes}
        assert cleared and not cleared & gone  # what was left, each announced once
    finally:
        llm.engine.close()
        sub.close()


def json_salt() -> str:
    """The salt of an SGLang ``extra_key`` request, as the server derives it."""
    from prefixkv.wire.kv_events import request_salt

    salt = request_salt(None, "team-b")
    assert salt is not None
    return salt


def test_the_array_encoding_serves_old_consumers(demo_model: Any) -> None:
    """``"encoding": "array"``: vLLM's pre-map layout, readable with the old structs."""
    llm = LLM(demo_model, block_size=4, kv_events_config=EVENTS.replace(
        '"topic"', '"encoding": "array", "topic"'))
    sink = llm.engine.kv.events
    assert sink is not None
    sub = Subscriber(sink.publisher.endpoint)
    try:
        prompt = list(range(3, 20))
        llm.generate([prompt], greedy())
        assert sub.sock.poll(2000)
        _, _, payload = sub.sock.recv_multipart()
        with pytest.raises(msgspec.ValidationError):
            DECODER.decode(payload)
        events = OLD_DECODER.decode(payload).events
        assert isinstance(events[0], OldStored)
        assert events[0].block_hashes == block_hashes(prompt, 4)[: len(events[0].block_hashes)]
        assert events[0].medium == "GPU"
    finally:
        llm.engine.close()
        sub.close()


def test_hashes_do_not_depend_on_the_python_hash_seed() -> None:
    code = ("import sys; from prefixkv.wire.kv_events import block_hashes; assert 'torch' not in "
            "sys.modules;"
            "print(block_hashes(list(range(40)), 8, ('salt', None)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2", "random")}
    assert len(outs) == 1
    assert eval(outs.pop()) == block_hashes(list(range(40)), 8, ("salt", None))


def test_replay_resends_buffered_batches_from_a_sequence_number() -> None:
    config = KVEventsConfig.parse(EVENTS)
    pub = ZmqEventPublisher(config)
    sink = KVEventSink(4, pub)
    ctx = zmq.Context()
    try:
        sink.stored([5, 6], None, list(range(8)), None)
        sink.removed([5])
        sink.reset([6], 0)
        deadline = time.monotonic() + 10
        while sink.published < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while dealer.poll(2000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replies.append(DECODER.decode(payload))
        events = [e for b in replies for e in b.events]
        assert [type(e) for e in events] == [BlockStored, BlockRemoved, AllBlocksCleared]
        assert events[1].block_hashes == [events[0].block_hashes[0]]
        dealer.close(linger=0)
    finally:
        sink.close()
        ctx.term()


class FailingPublisher:
    """A publisher whose socket is broken: every send raises."""

    endpoint = "inproc://broken"
    replay_endpoint = None
    topic = ""

    def __init__(self) -> None:
        self.sent = 0

    def send(self, batch: OurBatch) -> None:
        self.sent += 1
        raise OSError("socket gone")

    def service(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_broken_publisher_never_fails_a_request(demo_model: Any) -> None:
    llm = LLM(demo_model, block_size=4, num_kv_blocks=32)
    plain = llm.generate([list(range(3, 40))], greedy(4))[0].outputs[0].token_ids
    llm.engine.reset_prefix_cache()
    broken = FailingPublisher()
    llm.engine.kv.events = KVEventSink(4, broken)
    out = llm.generate([list(range(3, 40))], greedy(4))[0].outputs[0].token_ids
    assert out == plain
    deadline = time.monotonic() + 10
    while broken.sent == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broken.sent >= 1
    llm.engine.close()


def test_a_full_queue_drops_records_and_then_clears_the_subscribers() -> None:
    class Collect(FailingPublisher):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list[OurBatch] = []

        def send(self, batch: OurBatch) -> None:
            self.batches.append(batch)

    out = Collect()
    sink = KVEventSink(2, out, max_queue_size=2, poll_interval=0.5)
    for i in range(50):  # the thread drains slower than this fills
        sink.stored([i], None, [i, i], None)
    assert sink.dropped > 0
    sink.close()
    names = [type(e).__name__ for b in out.batches for e in b.events]
    assert "AllBlocksCleared" in names


@pytest.mark.parametrize("bad", ['{"enable_kv_cache_events": true, "publisher": "kafka"}',
                                 '{"enable_kv_cache_events": true, "bogus": 1}',
                                 '{"buffer_steps": 0}', "not json", "[1]"])
def test_bad_configs_are_value_errors(bad: str) -> None:
    with pytest.raises(ValueError, match="kv_events_config"):
        KVEventsConfig.parse(bad)


def test_config_defaults_follow_vllm() -> None:
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KVEventsConfig.parse("{}").enabled
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}'
                                    ).enabled
    with pytest.raises(OSError, match="cannot open"):
        ZmqEventPublisher(KVEventsConfig.parse('{"endpoint": "tcp://*:notaport"}'))
    with pytest.raises(ValueError, match="encoding"):
        KVEventsConfig.parse('{"encoding": "json"}')


def test_the_default_endpoint_binds_loopback_only() -> None:
    """Issue 40.7: with no endpoint the PUB socket binds 127.0.0.1:5557, not every interface;
    ``tcp://*:PORT`` still binds every interface (deliberate), a host address still connects."""
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert config.address == ("tcp://127.0.0.1:5557", True)
    assert KVEventsConfig.parse('{"endpoint": "tcp://*:5557"}').address == ("tcp://*:5557", True)
    assert KVEventsConfig.parse('{"endpoint": "tcp://10.0.0.2:5557"}').address[1] is False
    try:
        pub = ZmqEventPublisher(config)
    except OSError:
        pytest.skip("port 5557 is taken on this machine")
    try:
        assert pub.endpoint == "tcp://127.0.0.1:5557"
    finally:
        pub.close()


def test_a_dropped_llm_publishes_what_it_queued_then_frees_its_thread_and_sockets(
    demo_model: Any, helpers: Any
) -> None:
    """Without ``close()``: the sink thread sends the queued batch, closes its sockets and ends
    (it ran, with its bound port, for the life of the process)."""
    before = set(threading.enumerate())
    llm, sub = make(demo_model, block_size=4)
    try:
        llm.generate([list(range(3, 40))], greedy(2))
        threads = helpers.new_threads(before)
        assert threads
        del llm
        gc.collect()
        assert helpers.all_end(threads)
        assert any(isinstance(e, BlockStored) for e in sub.drain())
    finally:
        sub.close()  # (an open SUB socket would block the context's term at exit)


def test_close_without_waiting_lets_the_sink_finish_on_its_own() -> None:
    class Slow:
        endpoint, replay_endpoint, topic = "inproc://x", None, "kv"
        sent = 0
        closed = False

        def send(self, batch: Any) -> None:
            time.sleep(0.2)
            self.sent += 1

        def service(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    pub = Slow()
    sink = KVEventSink(4, pub)
    sink.stored([1], None, [5, 6, 7, 8], None)
    start = time.monotonic()
    sink.close(wait=False)
    assert time.monotonic() - start < 0.1  # does not wait for the slow send
    sink._thread.join(5)
    assert pub.sent == 1 and pub.closed  # the queued record went out, then the sockets closed


def test_a_construction_that_fails_after_the_tiers_started_leaves_no_thread(
    demo_model: Any, helpers: Any, tmp_path: Any
) -> None:
    """The KV events endpoint is taken: ``LLM(...)`` raises, and the disk tier's threads it had
    already started end (they ran for the life of the process, one pair per attempt)."""
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    try:
        taken.bind("tcp://127.0.0.1:*")
        port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        config = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}", "topic": "kv"}}'
        before = set(threading.enumerate())
        with pytest.raises(OSError, match="Address already in use"):
            LLM(demo_model, kv_disk_dir=tmp_path, kv_events_config=config)
        gc.collect()
        assert helpers.all_end(helpers.new_threads(before))
    finally:
        taken.close(linger=0)
        ctx.term()
