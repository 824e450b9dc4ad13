"""The vLLM connector's logic without vLLM (default suite): config, keys, the scheduler half's
lookups and plans over real tiers, the worker half's bytes over real tensors. The connector
against a real vLLM is tests/integrations/test_vllm_connector.py (marker ``vllm``)."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence, Set as AbstractSet
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from prefixkv.integrations.vllm.config import ConnectorConfig
from prefixkv.integrations.vllm.identity import KVGeometry, make_keyer, weights_fingerprint
from prefixkv.integrations.vllm.plan import DISK, GONE, HOST, REMOTE, LoadBlock, SaveBlock, StepPlan
from prefixkv.integrations.vllm.scheduler_side import SchedulerSide
from prefixkv.integrations.vllm.worker_side import WorkerSide

BS = 4
GEOM = KVGeometry("bfloat16", BS, 2, 8, 3, "FullAttentionSpec", "cpu")


def test_config_reads_vllm_units_and_names_bad_keys() -> None:
    assert ConnectorConfig.from_extra({"kv_offload_size": 1}).host_blocks(2**20) == 1024
    assert ConnectorConfig.from_extra({"kv_offload_size": "0.5"}).host_blocks(2**20) == 512
    assert ConnectorConfig.from_extra({"kv_offload_size": "3MiB"}).host_blocks(2**20) == 3
    disk_only = ConnectorConfig.from_extra({"kv_disk_dir": "/tmp/x", "kv_disk_size": "1GiB"})
    assert disk_only.host_blocks(2**20) == 0
    with pytest.raises(ValueError, match="kv_ofload_size"):
        ConnectorConfig.from_extra({"kv_ofload_size": 1})
    with pytest.raises(ValueError, match="names no tier"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ValueError, match="kv_remote"):
        ConnectorConfig.from_extra({"kv_remote": "http://x"})
    with pytest.raises(ValueError, match="kv_offload_size"):
        ConnectorConfig.from_extra({"kv_offload_size": "lots"})


def _safetensors(path: Path, payload: bytes) -> None:
    head = json.dumps({"w": {"dtype": "F32", "shape": [len(payload) // 4],
                             "data_offsets": [0, len(payload)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + payload)


def test_weights_fingerprint_follows_the_weights(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _safetensors(a / "model.safetensors", bytes(range(256)) * 64)
    _safetensors(b / "model.safetensors", bytes(range(256)) * 64)
    assert weights_fingerprint(a) == weights_fingerprint(b)
    _safetensors(b / "model.safetensors", bytes(range(255, -1, -1)) * 64)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    with pytest.raises(ValueError, match="no weight files"):
        weights_fingerprint(a / "missing")


def test_keys_differ_by_weights_geometry_namespace_and_salt() -> None:
    tokens = list(range(12))
    base = make_keyer("w1", "m", GEOM, "")
    chain = base.extend([], tokens, 3, ("", ""))
    assert chain == make_keyer("w1", "m", GEOM, "").extend([], tokens, 3, ("", ""))
    others = [
        make_keyer("w2", "m", GEOM, ""),
        make_keyer("w1", "m", KVGeometry("float32", BS, 2, 8, 3, "FullAttentionSpec", "cpu"), ""),
        make_keyer("w1", "m", KVGeometry("bfloat16", BS, 2, 8, 3, "FullAttentionSpec", "cuda"), ""),
        make_keyer("w1", "m", GEOM, "tenant-b"),
        make_keyer("w1", "m", GEOM, "", "abcd"),
    ]
    for keyer in others:
        assert not set(keyer.extend([], tokens, 3, ("", ""))) & set(chain)
    assert not set(base.extend([], tokens, 3, ("salt", ""))) & set(chain)
    assert not set(base.extend([], tokens, 3, ("", "lora-1"))) & set(chain)


def _request(rid: str, tokens: list[int], salt: str | None = None) -> Any:
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, cache_salt=salt, lora_request=None)


def _output(new: Sequence[Any] = (), cached: Sequence[tuple[str, list[int] | None, int]] = (),
            scheduled: dict[str, int] | None = None, finished: AbstractSet[str] = frozenset()) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=list(new), num_scheduled_tokens=scheduled or {},
        finished_req_ids=set(finished),
        preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached], resumed_req_ids=set(),
            new_block_ids=[(c[1],) if c[1] is not None else None for c in cached],
            num_computed_tokens=[c[2] for c in cached]))


def _side(tmp_path: Path | None = None, host: int = 8) -> SchedulerSide:
    return SchedulerSide(make_keyer("w", "m", GEOM, ""), host, tmp_path, None)


def test_scheduler_saves_full_blocks_then_finds_them_in_host() -> None:
    side = _side()
    tokens = list(range(10))  # two full blocks, two tokens over
    req = _request("a", tokens)
    side.track(req)
    assert side.matched_tokens(req, 0) == 0
    new = SimpleNamespace(req_id="a", block_ids=([7, 8, 9],), num_computed_tokens=0)
    plan = side.build(_output(new=[new], scheduled={"a": 10}))
    assert [s.block_id for s in plan.saves] == [7, 8] and all(s.slot is not None for s in plan.saves)
    assert plan.loads == []
    side.forget("a")
    again = _request("b", tokens + [99])
    assert side.matched_tokens(again, 0) == 2 * BS  # lookups hold nothing
    assert side.host is not None and side.host.num_held == 0
    assert side.matched_tokens(again, BS) == BS  # past vLLM's own one-block hit
    assert side.matched_tokens(_request("c", tokens[:8]), 0) == BS  # never the last token
    assert side.matched_tokens(_request("d", tokens, salt="x"), 0) == 0  # another salt


def test_scheduler_plans_loads_with_held_slots_and_skips_saving_them() -> None:
    side = _side()
    tokens = list(range(9))
    side.track(_request("a", tokens))
    first = side.build(_output(new=[SimpleNamespace(req_id="a", block_ids=([1, 2, 3],),
                                                    num_computed_tokens=0)], scheduled={"a": 9}))
    side.forget("a")
    req = _request("b", tokens)
    n = side.matched_tokens(req, 0)
    side.after_alloc(req, [4, 5, 6], n)
    assert side.host is not None and side.host.num_held == 2
    plan = side.build(_output(new=[SimpleNamespace(req_id="b", block_ids=([4, 5, 6],),
                                                   num_computed_tokens=n)], scheduled={"b": 1}))
    assert [(ld.block_id, ld.tier, ld.slot) for ld in plan.loads] == \
        [(4, HOST, first.saves[0].slot), (5, HOST, first.saves[1].slot)]
    assert plan.saves == [] and side.host.num_held == 0


def test_scheduler_host_lru_evicts_and_a_full_tier_still_plans_lower_tiers(tmp_path: Path) -> None:
    side = _side(tmp_path, host=1)
    tokens = list(range(8))
    side.track(_request("a", tokens))
    plan = side.build(_output(new=[SimpleNamespace(req_id="a", block_ids=([1, 2],),
                                                   num_computed_tokens=0)], scheduled={"a": 8}))
    assert [s.slot for s in plan.saves] == [0, 0]  # the second evicted the first (LRU)
    assert side.sources(side.track(_request("a", tokens)).keys.upto(tokens, 2)) == []
    (tmp_path / (plan.saves[0].key.hex() + ".kvb")).write_bytes(b"x")
    assert side.sources([plan.saves[0].key, plan.saves[1].key]) == [DISK, HOST]


def test_scheduler_remote_presence_extends_the_run() -> None:
    calls: list[int] = []

    def present(keys: Any) -> list[bool]:
        calls.append(len(keys))
        return [True, False][: len(keys)] + [False] * max(0, len(keys) - 2)

    side = SchedulerSide(make_keyer("w", "m", GEOM, ""), 0, None, present)
    keys = side.track(_request("a", list(range(13)))).keys.upto(list(range(13)), 3)
    assert side.sources(keys) == [REMOTE] and calls == [3]


def test_scheduler_cached_requests_grow_and_chunked_prefill_saves_each_chunk() -> None:
    side = _side()
    tokens = list(range(14))
    side.track(_request("a", tokens))
    p1 = side.build(_output(new=[SimpleNamespace(req_id="a", block_ids=([1],),
                                                 num_computed_tokens=0)], scheduled={"a": 5}))
    assert [s.block_id for s in p1.saves] == [1]
    p2 = side.build(_output(cached=[("a", [2, 3], 5)], scheduled={"a": 8}))
    assert [s.block_id for s in p2.saves] == [2, 3]
    p3 = side.build(_output(cached=[("a", None, 13)], scheduled={"a": 1}, finished={"a"}))
    assert p3.saves == [] and "a" not in side._requests


def test_scheduler_lost_host_slot_becomes_a_failed_load() -> None:
    side = _side(host=1)
    tokens = list(range(5))
    side.track(_request("a", tokens))
    side.build(_output(new=[SimpleNamespace(req_id="a", block_ids=([1, 2],),
                                            num_computed_tokens=0)], scheduled={"a": 5}))
    req = _request("b", tokens)
    n = side.matched_tokens(req, 0)
    assert side.host is not None
    side.host.clear()  # the block leaves between lookup and allocation
    side.after_alloc(req, [3, 4], n)
    plan = side.build(_output())
    assert [ld.tier for ld in plan.loads] == [GONE]


def _kv(num_blocks: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}": torch.randn(num_blocks, 2, BS, 16, generator=g).to(torch.bfloat16)
            for i in range(3)}


def test_worker_round_trips_blocks_through_host_and_disk(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": "1MiB", "kv_disk_dir": str(tmp_path)})
    worker = WorkerSide(cfg, host_blocks=4)
    kv = _kv()
    worker.register(kv, 6)
    assert worker.block_nbytes == 3 * 2 * BS * 16 * 2
    want = {b: [t[b].clone() for t in kv.values()] for b in (0, 1)}
    worker.run_loads(StepPlan())
    worker.save([SaveBlock(0, b"k0" * 16, slot=2), SaveBlock(1, b"k1" * 16, slot=None)])
    assert worker.flush()
    worker.run_loads(StepPlan(loads=[LoadBlock(4, b"k0" * 16, HOST, 2),
                                            LoadBlock(5, b"k1" * 16, DISK)]))
    assert worker.take_failed() == set()
    counts = worker.take_counts()
    assert (counts["host_blocks"], counts["disk_blocks"], counts["saved_host_blocks"]) == (1, 1, 1)
    assert counts["disk_bytes"] == worker.block_nbytes and counts.get("failed_blocks", 0) == 0
    for src, dst in ((0, 4), (1, 5)):
        for t, expect in zip(kv.values(), want[src]):
            assert torch.equal(t[dst], expect)
    worker.close()


def test_worker_never_loads_wrong_kv(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": "1MiB", "kv_disk_dir": str(tmp_path)})
    worker = WorkerSide(cfg, host_blocks=2)
    kv = _kv()
    worker.register(kv, 6)
    worker.save([SaveBlock(0, b"a" * 32, slot=0), SaveBlock(1, b"b" * 32, slot=None),
                 SaveBlock(2, b"c" * 32, slot=None)])
    assert worker.flush()
    path = tmp_path / ((b"b" * 32).hex() + ".kvb")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    trunc = tmp_path / ((b"c" * 32).hex() + ".kvb")
    trunc.write_bytes(trunc.read_bytes()[:100])
    before = kv["layer.0"][3].clone()
    worker.run_loads(StepPlan(loads=[
        LoadBlock(3, b"x" * 32, HOST, 0),  # slot 0 holds another key
        LoadBlock(4, b"b" * 32, DISK), LoadBlock(5, b"c" * 32, DISK),
        LoadBlock(1, b"z" * 32, GONE)]))
    worker.save([SaveBlock(3, b"x" * 32, slot=1)])  # a failed block is never stored
    assert worker.take_failed() == {3, 4, 5, 1}
    assert worker.take_counts()["failed_blocks"] == 4
    assert torch.equal(kv["layer.0"][3], before)
    assert worker.slot_keys[1] is None
    worker.close()


def test_worker_finds_the_block_dimension_of_other_layouts() -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": "1MiB"})
    worker = WorkerSide(cfg, host_blocks=2)
    gpu_like = {"l0": torch.randn(2, 5, BS, 2, 8)}  # [2, blocks, block_size, heads, head_dim]
    worker.register(gpu_like, 5)
    worker.save([SaveBlock(3, b"g" * 32, slot=0)])
    worker.run_loads(StepPlan(loads=[LoadBlock(1, b"g" * 32, HOST, 0)]))
    assert torch.equal(gpu_like["l0"][:, 1], gpu_like["l0"][:, 3])
    with pytest.raises(ValueError, match="no dimension of 7 blocks"):
        WorkerSide(cfg, 1).register({"l0": torch.zeros(2, 5, 4)}, 7)
