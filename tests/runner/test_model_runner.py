"""ModelRunner over paged KV vs the ``transformers`` implementation of the same weights."""

from __future__ import annotations

import pytest
import torch

from prefixkv.runner import ModelRunner, RunItem

ATOL = 1e-4


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Reference logits ``[len(tokens), vocab]`` of a full, uncached forward."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def scrambled(n: int, num_blocks: int, seed: int) -> list[int]:
    """``n`` distinct block ids in a shuffled order (the block table must be honoured)."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def tokens_for(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_cached_prefix_and_decode_match_hf(make_hf_model, arch, block_size):
    path, hf = make_hf_model(arch)
    runner = ModelRunner(path, block_size=block_size, num_kv_blocks=128)
    toks = tokens_for(40)
    ref = hf_logits(hf, toks)
    table = scrambled(-(-40 // block_size), 128, seed=block_size)

    # (a) full prefill of the first 21 tokens
    out = runner.execute([RunItem(toks[:21], 0, table)])
    assert out.dtype == torch.float32 and out.shape == (1, 300)
    torch.testing.assert_close(out[0], ref[20], atol=ATOL, rtol=0)
    # (b) a suffix chunk on top of the cached prefix (not block aligned)
    out = runner.execute([RunItem(toks[21:33], 21, table)])
    torch.testing.assert_close(out[0], ref[32], atol=ATOL, rtol=0)
    # (c) decode steps
    for p in range(33, 40):
        out = runner.execute([RunItem([toks[p]], p, table)])
        torch.testing.assert_close(out[0], ref[p], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_of_prefill_chunks_and_decodes(make_hf_model, arch):
    path, hf = make_hf_model(arch)
    bs = 4
    runner = ModelRunner(path, block_size=bs, num_kv_blocks=64)
    seqs = [tokens_for(30, seed=s) for s in range(4)]
    refs = [hf_logits(hf, s) for s in seqs]
    ids = scrambled(32, 64, seed=7)
    tables = [ids[i * 8 : (i + 1) * 8] for i in range(4)]
    # Warm-up: seq 0 and 1 get 17 and 29 tokens cached, seq 2 gets 10.
    runner.execute(
        [
            RunItem(seqs[0][:17], 0, tables[0]),
            RunItem(seqs[1][:29], 0, tables[1]),
            RunItem(seqs[2][:10], 0, tables[2]),
        ]
    )
    out = runner.execute(
        [
            RunItem([seqs[0][17]], 17, tables[0]),  # decode
            RunItem(seqs[2][10:25], 10, tables[2]),  # prefill chunk on a cached prefix
            RunItem([seqs[1][29]], 29, tables[1]),  # decode, longer context
            RunItem(seqs[3][:12], 0, tables[3]),  # fresh prefill
        ]
    )
    torch.testing.assert_close(out[0], refs[0][17], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], refs[2][24], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2], refs[1][29], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[3], refs[3][11], atol=ATOL, rtol=0)


def test_partial_block_reuse_by_copying_rows(make_hf_model):
    path, hf = make_hf_model("qwen3")
    bs = 4
    runner = ModelRunner(path, block_size=bs, num_kv_blocks=16)
    a = tokens_for(10, seed=3)
    b = a + tokens_for(9, seed=4)  # shares all 10 tokens of a, then diverges
    runner.execute([RunItem(a, 0, [5, 9, 2])])  # block 2 holds rows 0-1 (positions 8, 9)
    table_b = [5, 9, 11, 12, 13]
    runner.copy_block_rows(2, 11, 2)
    out = runner.execute([RunItem(b[10:], 10, table_b)])
    torch.testing.assert_close(out[0], hf_logits(hf, b)[-1], atol=ATOL, rtol=0)
    # The source block is untouched, so a keeps decoding correctly.
    out = runner.execute([RunItem([7], 10, [5, 9, 2])])
    torch.testing.assert_close(out[0], hf_logits(hf, a + [7])[-1], atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads_and_matches(make_hf_model):
    path, hf = make_hf_model("llama", shard=True)
    assert (path / "model.safetensors.index.json").is_file()
    runner = ModelRunner(path, block_size=8, num_kv_blocks=8)
    toks = tokens_for(20)
    out = runner.execute([RunItem(toks, 0, [3, 1, 6])])
    torch.testing.assert_close(out[0], hf_logits(hf, toks)[-1], atol=ATOL, rtol=0)


def test_bfloat16_runs_close_to_float32(make_hf_model):
    path, _ = make_hf_model("qwen3")
    toks = tokens_for(24)
    table = list(range(6))
    f32 = ModelRunner(path, block_size=4, num_kv_blocks=8)
    ref = f32.execute([RunItem(toks[:23], 0, table)])
    ref_decode = f32.execute([RunItem(toks[23:], 23, table)])
    runner = ModelRunner(path, block_size=4, num_kv_blocks=8, dtype="bfloat16")
    assert runner.kv_pool.kv.dtype == torch.bfloat16
    runner.execute([RunItem(toks[:20], 0, table)])
    out = runner.execute([RunItem(toks[20:23], 20, table)])  # chunk on a cached prefix
    out_decode = runner.execute([RunItem(toks[23:], 23, table)])
    for got, want in ((out, ref), (out_decode, ref_decode)):
        assert got.dtype == torch.float32
        assert (got - want).abs().max() < 0.3 * want.abs().max()
        assert got.argmax() == want.argmax()


def test_pool_sizing(make_hf_model):
    path, _ = make_hf_model("qwen3")
    # 2 layers * 2 (K, V) * 2 kv heads * head_dim 32 * 4 bytes = 1 KiB per token
    runner = ModelRunner(path, block_size=16, kv_cache_memory_bytes=16 * 1024 * 10 + 5)
    assert runner.num_kv_blocks == 10
    runner = ModelRunner(path, block_size=16)
    assert runner.max_model_len == 256
    assert runner.num_kv_blocks == 4 * 256 // 16
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        ModelRunner(path, kv_cache_memory_bytes=100)
    with pytest.raises(ValueError, match="not both"):
        ModelRunner(path, num_kv_blocks=4, kv_cache_memory_bytes=1 << 20)


def test_execute_rejects_bad_items(make_hf_model):
    path, _ = make_hf_model("qwen3")
    runner = ModelRunner(path, block_size=4, num_kv_blocks=8)
    with pytest.raises(ValueError, match="items must not be empty"):
        runner.execute([])
    with pytest.raises(ValueError, match=r"items\[0\].token_ids must not be empty"):
        runner.execute([RunItem([], 0, [0])])
    with pytest.raises(ValueError, match=r"items\[1\].block_table has 1 blocks, 2 needed"):
        runner.execute([RunItem([1], 0, [0]), RunItem([1, 2, 3], 2, [1])])
    with pytest.raises(ValueError, match="outside"):
        runner.execute([RunItem([1, 2], 0, [8])])
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute([RunItem([1], 256, list(range(8)))])
    with pytest.raises(ValueError, match="token_ids has ids outside"):
        runner.execute([RunItem([300], 0, [0])])
    with pytest.raises(ValueError, match="num_rows"):
        runner.copy_block_rows(0, 1, 5)
