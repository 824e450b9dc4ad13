"""The worker's Valkey loads streaming in layer by layer while vLLM's forward pass runs (default
suite: the connector's worker half over real tensors and a real valkey-server; the same path
under a real vLLM is tests/integrations/test_vllm_connector.py's Valkey tests)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from prefixkv.integrations.vllm.config import ConnectorConfig
from prefixkv.integrations.vllm.plan import REMOTE, LoadBlock, SaveBlock, StepPlan
from prefixkv.integrations.vllm.streamed_load import PIECES
from prefixkv.integrations.vllm.worker_side import WorkerSide
from prefixkv.tiers.remote import PREFIX

LAYERS = 12
BLOCKS = 10


def _kv(seed: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout, [blocks, kv_heads, block_size, 2*head_dim], 12 layers."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, 2, 16, 64, generator=g)
            for i in range(LAYERS)}


def _saved(url: str, n: int) -> tuple[dict[str, torch.Tensor], list[bytes]]:
    """A worker that saved blocks 0..n-1 to Valkey (as instance A would): its KV and the keys."""
    writer = WorkerSide(ConnectorConfig.from_extra({"kv_remote": url}), host_blocks=0)
    kv = _kv(0)
    writer.register(kv, BLOCKS)
    keys = [bytes([i + 1]) * 32 for i in range(n)]
    writer.save([SaveBlock(i, k, slot=None) for i, k in enumerate(keys)])
    assert writer.flush()
    writer.close()
    return kv, keys


def test_each_layer_is_in_place_when_its_wait_returns(valkey_server: Any) -> None:
    want, keys = _saved(valkey_server.url, 4)
    worker = WorkerSide(ConnectorConfig.from_extra({"kv_remote": valkey_server.url}), 0)
    kv = _kv(1)
    worker.register(kv, BLOCKS)
    dst = [6, 7, 8, 9]
    worker.run_loads(StepPlan(loads=[LoadBlock(b, k, REMOTE) for b, k in zip(dst, keys)]))
    assert worker.streaming is not None  # the step goes on while the blocks stream in
    for i, (name, t) in enumerate(kv.items()):  # the forward pass, layer by layer
        worker.wait_layer(name)
        for src, b in enumerate(dst):
            assert torch.equal(t[b], want[name][src]), (name, b)
    worker.end_loads()
    assert worker.take_failed() == set()
    counts = worker.take_counts()
    assert counts["remote_blocks"] == 4 and counts["remote_bytes"] == 4 * worker.block_nbytes
    assert worker.streaming is None
    worker.close()


def test_a_damaged_record_is_a_load_error_of_the_step(valkey_server: Any) -> None:
    want, keys = _saved(valkey_server.url, 3)
    worker = WorkerSide(ConnectorConfig.from_extra({"kv_remote": valkey_server.url}), 0)
    kv = _kv(1)
    worker.register(kv, BLOCKS)
    assert worker.remote is not None
    client = worker.remote._client
    record = bytearray(client.get(PREFIX + keys[1]))
    record[-7] ^= 0x01  # the last layer's bytes: only the checksum can tell
    client.set(PREFIX + keys[1], bytes(record))
    worker.run_loads(StepPlan(loads=[LoadBlock(5 + i, k, REMOTE) for i, k in enumerate(keys)]))
    for name in kv:
        worker.wait_layer(name)
    worker.save([SaveBlock(6, keys[1], slot=None)])  # ends the loads first; a failed block is not saved
    assert worker.take_failed() == {6}
    assert torch.equal(kv["model.layers.0.self_attn.attn"][5], want["model.layers.0.self_attn.attn"][0])
    assert worker.take_counts()["remote_failed_blocks"] == 1
    assert client.exists(PREFIX + keys[1]) == 0  # deleted: the next engine to compute it writes it
    worker.close()


def test_a_dead_server_never_leaves_the_forward_pass_waiting(valkey_server: Any) -> None:
    _, keys = _saved(valkey_server.url, 3)
    worker = WorkerSide(ConnectorConfig.from_extra({"kv_remote": valkey_server.url,
                                                    "kv_remote_timeout": 0.5}), 0)
    kv = _kv(1)
    worker.register(kv, BLOCKS)
    valkey_server.kill()
    worker.run_loads(StepPlan(loads=[LoadBlock(5 + i, k, REMOTE) for i, k in enumerate(keys)]))
    done = threading.Event()

    def forward() -> None:
        for name in kv:
            worker.wait_layer(name)
        done.set()

    t0 = time.monotonic()
    threading.Thread(target=forward, daemon=True).start()
    assert done.wait(10) and time.monotonic() - t0 < 5
    worker.end_loads()
    assert worker.take_failed() == {5, 6, 7}
    worker.close()


def test_layers_are_cut_into_runs_in_the_caches_order() -> None:
    worker = WorkerSide(ConnectorConfig.from_extra({"kv_offload_size": "1MiB"}), 0)
    worker.register(_kv(0), BLOCKS)
    assert worker.kv is not None
    cuts, piece_of = worker.kv.cuts(PIECES)
    assert len(cuts) == PIECES + 1 and cuts[0] == 0 and cuts[-1] == worker.block_nbytes
    assert piece_of == sorted(piece_of) and set(piece_of) == set(range(PIECES))
    assert piece_of.count(0) == 1  # the first layer alone: the forward pass starts sooner
    worker.close()
