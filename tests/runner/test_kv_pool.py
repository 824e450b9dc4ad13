"""KVPool: shape, sizing arithmetic, partial-row copies across all layers."""

from __future__ import annotations

import pytest
import torch

from prefixkv.runner import KVPool


def make_pool(**over) -> KVPool:
    kw = {
        "num_layers": 3,
        "num_blocks": 5,
        "block_size": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": torch.float32,
        "device": torch.device("cpu"),
    }
    return KVPool(**{**kw, **over})


def test_shape_zeroed_and_sized():
    pool = make_pool()
    assert pool.kv.shape == (2, 3, 5, 4, 2, 8)
    assert not pool.kv.any()
    per_block = KVPool.bytes_per_block(
        num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32
    )
    assert per_block == 2 * 3 * 4 * 2 * 8 * 4
    assert pool.nbytes == 5 * per_block
    k, v = pool.layer(1)
    assert k.shape == v.shape == (5, 4, 2, 8)
    k[2, 0] = 1.0
    assert pool.kv[0, 1, 2, 0].eq(1.0).all()  # views, not copies


def test_copy_rows_copies_only_the_first_rows_in_every_layer():
    pool = make_pool()
    pool.kv.normal_()
    before = pool.kv.clone()
    pool.copy_rows(1, 3, 3)
    assert torch.equal(pool.kv[:, :, 3, :3], before[:, :, 1, :3])
    assert torch.equal(pool.kv[:, :, 3, 3:], before[:, :, 3, 3:])
    others = [0, 1, 2, 4]
    assert torch.equal(pool.kv[:, :, others], before[:, :, others])
    pool.copy_rows(2, 2, 4)
    pool.copy_rows(0, 4, 0)
    assert torch.equal(pool.kv[:, :, 4], before[:, :, 4])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((5, 0, 1), "src_block=5"),
        ((0, -1, 1), "dst_block=-1"),
        ((0, 1, 5), "num_rows=5"),
    ],
)
def test_copy_rows_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        make_pool().copy_rows(*args)


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        make_pool(num_blocks=0)
