"""Per-tenant quotas in the vLLM connector's tiers (issue 43, item 3; without vLLM): the
``kv_blocks_per_tenant`` extra config key; the scheduler half's host tier keeps a tenant's blocks
while another floods it far past its quota; each save carries its request's tenant to the
worker half, whose disk tier counts and enforces the same way."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from prefixkv.integrations.vllm.config import ConnectorConfig
from prefixkv.integrations.vllm.identity import KVGeometry, make_keyer
from prefixkv.integrations.vllm.plan import SaveBlock
from prefixkv.integrations.vllm.scheduler_side import SchedulerSide
from prefixkv.integrations.vllm.worker_side import WorkerSide
from prefixkv.tiers import tenant_label

BS = 4
GEOM = KVGeometry("bfloat16", BS, 2, 8, 3, "FullAttentionSpec", "cpu")
A, B = tenant_label(("salt-a", "")), tenant_label(("salt-b", ""))


def _request(rid: str, tokens: list[int], salt: str | None) -> Any:
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, cache_salt=salt, lora_request=None)


def _new(rid: str, blocks: list[int], n: int) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=0)],
        num_scheduled_tokens={rid: n}, finished_req_ids=set(), preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]))


def _run(side: SchedulerSide, rid: str, salt: str | None, seed: int) -> list[SaveBlock]:
    tokens = [seed * 100 + i for i in range(2 * BS + 1)]  # two full blocks
    side.track(_request(rid, tokens, salt))
    saves = side.build(_new(rid, [1, 2, 3], len(tokens))).saves
    side.forget(rid)
    return saves


def test_config_takes_kv_blocks_per_tenant() -> None:
    cfg = ConnectorConfig.from_extra({"kv_offload_size": "1MiB", "kv_blocks_per_tenant": "host=2"})
    assert cfg.spec.tenant_quotas(None) == {"host": 2, "disk": None, "remote": None}
    with pytest.raises(ValueError, match="kv_blocks_per_tenant"):
        ConnectorConfig.from_extra({"kv_offload_size": "1MiB", "kv_blocks_per_tenant": "gpu=2"})


@pytest.mark.parametrize("quota", [3, None])
def test_host_tier_keeps_a_tenants_blocks_while_another_floods(quota: int | None) -> None:
    side = SchedulerSide(make_keyer("w", "m", GEOM, ""), 8, None, None, host_quota=quota)
    quiet = _run(side, "b", "salt-b", 0)
    assert [s.tenant for s in quiet] == [B, B] and all(s.slot is not None for s in quiet)
    for i in range(20):
        assert {s.tenant for s in _run(side, f"a{i}", "salt-a", i + 1)} == {A}
    assert side.host is not None
    kept = [s.key in side.host for s in quiet]
    if quota is None:  # the control: plain LRU flushes B
        assert kept == [False, False]
    else:
        assert kept == [True, True] and side.host.tenants.counts() == {B: 2, A: 6}
    assert {s.tenant for s in _run(side, "d", None, 99)} == {"default"}


def test_worker_disk_counts_each_saves_tenant(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra({"kv_disk_dir": str(tmp_path), "kv_disk_size": "6blocks",
                                      "kv_blocks_per_tenant": "disk=3"})
    worker = WorkerSide(cfg, host_blocks=0)
    g = torch.Generator().manual_seed(0)
    worker.register({f"layer.{i}": torch.randn(4, 2, BS, 16, generator=g).to(torch.bfloat16)
                     for i in range(3)}, 4)
    worker.save([SaveBlock(0, bytes([200 + i]) * 32, None, "b", B) for i in range(2)])
    assert worker.flush()
    for i in range(12):
        worker.save([SaveBlock(1, bytes([i]) * 32, None, f"a{i}", A)])
        assert worker.flush()
    assert worker.disk is not None
    assert worker.disk.tenant_counts() == {B: 2, A: 4}
    assert all(worker.disk.contains(bytes([200 + i]) * 32) for i in range(2))
    worker.close()
