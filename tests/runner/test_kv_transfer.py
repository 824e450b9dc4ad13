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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_pinned_host_arena() -> None:
    pool = KVPool(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.bfloat16, device=torch.device("cuda"))
    pool.kv.normal_()
    orig = pool.kv.clone()
    t = KVTransfer(pool, host_blocks=4)
    assert t.host.is_pinned() and t.host.device.type == "cpu"
    t.to_host([1, 2, 3], [0, 1, 2])
    t.from_host([0, 1, 2], [5, 6, 7])
    assert torch.equal(pool.kv[:, :, 5:8], orig[:, :, 1:4])
    raw = t.read_blocks([4])
    t.write_block(0, raw[0])
    assert torch.equal(pool.kv[:, :, 0], orig[:, :, 4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_host_tier_outputs_equal() -> None:
    from prefixkv.engine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(40, 140)) + [i] for i in range(3)]
    cold = LLM(device="cuda", dtype="float32", enable_prefix_caching=False, num_kv_blocks=64)
    ref = cold.generate(prompts, greedy)
    llm = LLM(device="cuda", dtype="float32", num_kv_blocks=64, kv_offload_size=64)
    llm.generate(prompts, greedy)
    llm.engine.kv.spill()
    outs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert outs[0].num_cached_tokens == 96


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_stream_copies_are_ordered_with_compute() -> None:
    """Offloads and loads run on a side stream without a host wait: an offloaded block may be
    overwritten by the very next kernel (it still reaches the arena intact), and a loaded block
    is what the next kernel reads."""
    pool = KVPool(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64,
                  dtype=torch.float32, device=torch.device("cuda"))
    t = KVTransfer(pool, host_blocks=32)
    assert t._stream is not None
    for _ in range(3):
        big = torch.randn(4096, 4096, device="cuda")
        pool.kv.normal_()
        _ = big @ big  # queued compute ahead of the copies
        want = pool.kv[:, :, :32].clone()
        t.to_host(list(range(32)), list(range(32)))
        pool.kv[:, :, :32].fill_(-1.0)  # the freed blocks reused at once, on the compute stream
        t.from_host(list(range(32)), list(range(32, 64)))
        got = pool.kv[:, :, 32:64].sum()  # the next "kernel" reads the loaded blocks
        torch.cuda.synchronize()
        assert torch.equal(t.host[:32].to("cuda").movedim(0, 2), want)
        assert torch.equal(pool.kv[:, :, 32:64], want) and got.item() == pytest.approx(want.sum().item())
