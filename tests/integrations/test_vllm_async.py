"""The vLLM connector's asynchronous saves, KV events and pins without vLLM (default suite):
the save thread and vLLM's ``get_finished`` contract, the scheduler half's answers to
``request_finished`` and its tier events, pins over the real host / disk / Valkey tiers."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch
from test_vllm_logic import BS, _kv, _output, _request

from prefixkv.integrations.vllm.config import ConnectorConfig, PinnedPrefix
from prefixkv.integrations.vllm.events import (
    DISK_MEDIUM,
    HOST_MEDIUM,
    BlockFacts,
    TierEvents,
)
from prefixkv.integrations.vllm.identity import make_keyer, prefix_keys
from prefixkv.integrations.vllm.plan import DISK, HOST, LoadBlock, SaveBlock, StepPlan
from prefixkv.integrations.vllm.saver import SaveQueue
from prefixkv.integrations.vllm.scheduler_side import SchedulerSide
from prefixkv.integrations.vllm.worker_side import WorkerSide
from prefixkv.integrations.vllm.identity import KVGeometry

GEOM = KVGeometry("bfloat16", BS, 2, 8, 3, "FullAttentionSpec", "cpu")


def _save(block: int, rid: str, slot: int | None = None) -> SaveBlock:
    return SaveBlock(block, bytes([block]) * 32, slot, rid)


# ---------------------------------------------------------------------- the save thread
def test_save_queue_reports_a_finished_request_only_once_its_copies_are_done() -> None:
    gate = threading.Event()
    copied: list[int] = []

    def copy(saves: Any) -> None:
        gate.wait(10)
        copied.extend(s.block_id for s in saves)

    q = SaveQueue(copy)
    q.submit([_save(1, "a"), _save(2, "b")], [_save(1, "a"), _save(2, "b")])
    q.submit([_save(3, "c")], [])  # planned, nothing left to copy (its load failed)
    assert q.finished({"a", "b", "c", "never-saved"}) == {"c"}  # a and b still copying
    assert q.finished(set()) == set()
    assert not q.wait(0.05) and q.pending == 1
    gate.set()
    assert q.wait(10) and copied == [1, 2]
    assert q.finished(set()) == {"a", "b"}  # noted as finished earlier, reported now
    assert q.finished({"a", "b", "c"}) == set()  # each reported once
    q.close()


def test_save_queue_survives_a_failing_copy_and_copies_inline_after_close() -> None:
    calls: list[int] = []

    def copy(saves: Any) -> None:
        calls.append(len(saves))
        if len(calls) == 1:
            raise RuntimeError("disk full")

    q = SaveQueue(copy)
    q.submit([_save(1, "a")], [_save(1, "a")])
    q.submit([_save(2, "b")], [_save(2, "b")])
    assert q.wait(10) and q.finished({"a", "b"}) == {"a", "b"}  # a failed save frees too
    q.close()
    q.submit([_save(3, "c")], [_save(3, "c")])  # after close: copied at once
    assert calls == [1, 1, 1]


def test_worker_saves_asynchronously_and_host_loads_wait_for_their_copy(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": "1MiB", "kv_disk_dir": str(tmp_path)})
    worker = WorkerSide(cfg, host_blocks=4)
    kv = _kv()
    worker.register(kv, 6)
    want = [t[0].clone() for t in kv.values()]
    worker.run_loads(StepPlan())
    worker.save([SaveBlock(0, b"k" * 32, 1, "r1")])
    # the next step loads that slot at once: the load waits for the copy, never reads a stale row
    worker.run_loads(StepPlan(loads=[LoadBlock(5, b"k" * 32, HOST, 1)]))
    assert worker.take_failed() == set()
    assert all(torch.equal(t[5], w) for t, w in zip(kv.values(), want))
    assert worker.finished({"r1"}) == ({"r1"}, set())
    assert worker.flush()
    stored, dropped = worker.take_disk_changes()
    assert stored == [b"k" * 32] and dropped == []
    assert worker.take_disk_changes() == ([], [])
    worker.close()


def test_worker_preemption_waits_for_queued_copies() -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": "1MiB"})
    worker = WorkerSide(cfg, host_blocks=2)
    kv = _kv()
    worker.register(kv, 6)
    gate = threading.Event()
    copy = worker.saver._copy

    def slow_copy(saves: Sequence[SaveBlock]) -> None:
        gate.wait(10)
        copy(saves)

    def preempt() -> None:
        worker.preempted(StepPlan(preempted=True))
        done.set()

    worker.saver._copy = slow_copy
    worker.save([SaveBlock(2, b"p" * 32, 0, "r")])
    done = threading.Event()
    waiter = threading.Thread(target=preempt)
    waiter.start()
    assert not done.wait(0.1)  # blocks 2's copy is still queued: vLLM must not reuse it yet
    gate.set()
    assert done.wait(10)
    waiter.join()
    assert worker.slot_keys[0] == b"p" * 32
    worker.preempted(StepPlan())  # nothing preempted: returns at once
    worker.close()


def test_worker_async_loads_report_the_request_and_its_failed_blocks(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": "1MiB", "kv_disk_dir": str(tmp_path)})
    worker = WorkerSide(cfg, host_blocks=2)
    kv = _kv()
    worker.register(kv, 6)
    worker.save([SaveBlock(0, b"h" * 32, 0, "w"), SaveBlock(1, b"d" * 32, None, "w")])
    assert worker.flush()
    want = [t[1].clone() for t in kv.values()]
    worker.run_loads(StepPlan(recv=[
        LoadBlock(3, b"h" * 32, HOST, 0, "r"), LoadBlock(4, b"d" * 32, DISK, None, "r"),
        LoadBlock(5, b"missing" + b"." * 25, DISK, None, "s")]))
    assert worker.take_failed() == set()  # nothing is known before the loads finish
    deadline = time.monotonic() + 10
    recving: set[str] = set()
    while recving != {"r", "s"} and time.monotonic() < deadline:
        recving |= worker.finished(set())[1]
        time.sleep(0.01)
    assert recving == {"r", "s"}
    assert worker.take_failed() == {5}  # reported with its request
    assert all(torch.equal(t[4], w) for t, w in zip(kv.values(), want))
    assert worker.finished(set()) == (set(), set())
    worker.close()


# ---------------------------------------------------------------------- scheduler half
def _side(host: int = 8, pins: Any = (), events: TierEvents | None = None,
          disk: Path | None = None) -> SchedulerSide:
    return SchedulerSide(make_keyer("w", "m", GEOM, ""), host, disk, None, pins=pins,
                         events=events)


def _facts(request: Any, j: int) -> BlockFacts:
    toks = tuple(request.all_token_ids[j * BS : (j + 1) * BS])
    return BlockFacts(block_hash=hash(toks), parent_hash=None, token_ids=toks)


def _new(rid: str, blocks: list[int]) -> Any:
    return SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=0)


def test_request_finished_keeps_blocks_only_for_requests_with_saves() -> None:
    side = _side()
    tokens = list(range(9))
    side.track(_request("a", tokens))
    side.track(_request("b", tokens[:3]))  # no full block: nothing to save
    plan = side.build(_output(new=[_new("a", [1, 2, 3]), _new("b", [4])],
                              scheduled={"a": 9, "b": 3}))
    assert {s.req_id for s in plan.saves} == {"a"}
    assert side.finished("a") is True and side.finished("b") is False
    assert side.finished("a") is False  # asked once per request


def test_async_loads_go_to_recv_and_hold_host_slots_until_done() -> None:
    side = SchedulerSide(make_keyer("w", "m", GEOM, ""), 8, None, None, load_async=True)
    tokens = list(range(9))
    side.track(_request("a", tokens))
    side.build(_output(new=[_new("a", [1, 2, 3])], scheduled={"a": 9}))
    side.forget("a")
    req = _request("b", tokens)
    n = side.matched_tokens(req, 0)
    side.after_alloc(req, [4, 5, 6], n)
    plan = side.build(_output())
    assert plan.loads == [] and [(ld.block_id, ld.req_id) for ld in plan.recv] == \
        [(4, "b"), (5, "b")]
    assert side.host is not None and side.host.num_held == 2  # held past the step's build
    side.after_alloc(req, [4, 5, 6], 0)  # vLLM's second call, once loaded: nothing new
    side.recv_done({"b"})
    assert side.host.num_held == 0


def test_plans_flag_preemptions_and_carry_pins_once() -> None:
    keyer = make_keyer("w", "m", GEOM, "")
    pins = prefix_keys(keyer, list(range(9)))
    assert len(pins) == 2  # full blocks only
    side = _side(pins=pins)
    first = side.build(_output())
    second = side.build(_output())
    assert first.pins == tuple(pins) and second.pins == ()
    out = _output()
    out.preempted_req_ids = {"x"}
    assert side.build(out).preempted and not first.preempted


def test_pinned_blocks_hold_in_the_host_tier() -> None:
    keyer = make_keyer("w", "m", GEOM, "")
    pinned = list(range(4))
    side = _side(host=1, pins=prefix_keys(keyer, pinned))
    side.track(_request("p", pinned + [99]))
    plan = side.build(_output(new=[_new("p", [1, 2])], scheduled={"p": 5}))
    assert [s.slot for s in plan.saves] == [0]
    side.track(_request("q", list(range(50, 55))))
    plan = side.build(_output(new=[_new("q", [3, 4])], scheduled={"q": 5}))
    assert [s.slot for s in plan.saves] == []  # the only slot holds a pinned block
    assert side.matched_tokens(_request("r", pinned + [7]), 0) == BS
    # the same prefix under another salt is another key: not pinned
    assert prefix_keys(keyer, pinned, "t") != prefix_keys(keyer, pinned)


def test_host_and_disk_tier_events() -> None:
    events = TierEvents(_facts)
    side = _side(host=1, events=events)
    t1, t2 = list(range(5)), list(range(10, 15))
    side.track(_request("a", t1))
    plan = side.build(_output(new=[_new("a", [1, 2])], scheduled={"a": 5}))
    k1 = plan.saves[0].key
    got = events.take()
    assert [(e.stored, e.medium, e.key) for e in got] == [(True, HOST_MEDIUM, k1)]
    assert got[0].facts.token_ids == tuple(t1[:BS])
    side.track(_request("b", t2))
    k2 = side.build(_output(new=[_new("b", [3, 4])], scheduled={"b": 5})).saves[0].key
    assert [(e.stored, e.medium, e.key) for e in events.take()] == \
        [(False, HOST_MEDIUM, k1), (True, HOST_MEDIUM, k2)]  # LRU eviction, then the new one
    side.tier_changed(DISK_MEDIUM, [k1, b"unknown" * 4], [k2])  # a key without facts: skipped
    assert [(e.stored, e.medium, e.key) for e in events.take()] == \
        [(True, DISK_MEDIUM, k1), (False, DISK_MEDIUM, k2)]
    side.reset()
    assert [(e.stored, e.medium, e.key) for e in events.take()] == [(False, HOST_MEDIUM, k2)]
    assert events.take() == []


def test_tier_events_keep_facts_for_a_bounded_number_of_keys() -> None:
    events = TierEvents(_facts, facts_kept=2)
    req = _request("a", list(range(12)))
    for j, key in enumerate((b"1", b"2", b"3")):
        events.learn(req, j, key)
    events.change(True, DISK_MEDIUM, [b"1", b"2", b"3"])
    assert [e.key for e in events.take()] == [b"2", b"3"]


# ---------------------------------------------------------------------- pins, config
def test_config_reads_pinned_prefixes_and_names_bad_entries() -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": 1, "kv_pin_prefixes": [
        "You are a helpful assistant.", [1, 2, 3], {"prompt": [4, 5], "cache_salt": "t"}]})
    assert cfg.pins == (PinnedPrefix("You are a helpful assistant."), PinnedPrefix((1, 2, 3)),
                        PinnedPrefix((4, 5), "t"))
    bad: Any
    with pytest.raises(ValueError, match="kv_load_async"):
        ConnectorConfig.from_extra({"kv_offload_size": 1, "kv_load_async": "yes"})
    assert ConnectorConfig.from_extra({"kv_offload_size": 1, "kv_load_async": True}).load_async
    for bad in ("sys", [[]], [[1, -2]], [{"tokens": [1]}], [{"prompt": "x", "cache_salt": 3}],
                [True], [""]):
        with pytest.raises(ValueError, match="kv_pin_prefixes"):
            ConnectorConfig.from_extra({"kv_offload_size": 1, "kv_pin_prefixes": bad})


def test_worker_pins_hold_in_disk_and_stay_without_expiry_in_valkey(
        tmp_path: Path, valkey_server: Any) -> None:
    cfg = ConnectorConfig.from_extra({"kv_disk_dir": str(tmp_path), "kv_disk_size": 2,
                                      "kv_remote": valkey_server.url, "kv_remote_ttl": 300,
                                      "kv_remote_timeout": 5})
    worker = WorkerSide(cfg, host_blocks=0)
    kv = _kv()
    worker.register(kv, 6)
    pin = b"P" * 32
    worker.run_loads(StepPlan(pins=(pin,)))
    worker.save([SaveBlock(0, pin, None, "a"), SaveBlock(1, b"x" * 32, None, "a")])
    assert worker.flush()
    worker.save([SaveBlock(2, b"y" * 32, None, "b"), SaveBlock(3, b"z" * 32, None, "b")])
    assert worker.flush()
    assert worker.disk is not None
    assert set(worker.disk.stored_keys()) == {pin, b"z" * 32}  # full: the pinned one stays
    client = redis.Redis.from_url(valkey_server.url)
    assert client.ttl(b"pkv:" + pin) == -1  # stored, no expiry: the server never evicts it
    assert 0 < client.ttl(b"pkv:" + b"x" * 32) <= 300
    assert client.get(b"pkv:pin:" + pin) == b"1"
    worker.close()
