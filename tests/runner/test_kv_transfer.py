from __future__ import annotations

import pytest
import torch

from prefixkv.runner.kv_pool import KVPool
from prefixkv.runner.kv_transfer import KVTransfer, model_fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_roundtrip_through_host_and_bytes(dtype: torch.dtype) -> None:
    pool = KVPool(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8,
                  dtype=dtype, device=torch.device("cpu"))
    pool.kv.normal_()
    orig = pool.kv.clone()
    t = KVTransfer(pool, host_blocks=3)
    assert t.layout == f"{str(dtype)[6:]}:2x3x4x2x8"
    assert t.block_nbytes == 2 * 3 * 4 * 2 * 8 * pool.kv.element_size()
    assert t.host_nbytes == 3 * t.block_nbytes
    t.to_host([1, 4], [2, 0])
    t.from_host([0, 2], [5, 0])
    assert torch.equal(pool.kv[:, :, 5], orig[:, :, 4]) and torch.equal(pool.kv[:, :, 0], orig[:, :, 1])
    raw = t.read_blocks([2, 3])
    assert [len(r) for r in raw] == [t.block_nbytes] * 2
    t.write_block(1, raw[1])
    assert torch.equal(pool.kv[:, :, 1], orig[:, :, 3])
    with pytest.raises(ValueError, match="bytes"):
        t.write_block(1, raw[1][:-1])
    with pytest.raises(ValueError, match="host_blocks"):
        KVTransfer(pool, -1)


def test_fingerprint_sees_weights() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    fp = model_fingerprint(m)
    assert fp == model_fingerprint(m) and len(fp) == 32
    with torch.no_grad():
        m.weight[3, 3] += 1.0
    assert model_fingerprint(m) != fp
