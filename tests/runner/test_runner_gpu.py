"""The runner on CUDA (skipped without it): fp32 matches transformers, bf16 stays close."""

from __future__ import annotations

import pytest
import torch

from prefixkv.runner import ModelRunner, RunItem, SamplingRow, make_generator, sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_prefill_cached_suffix_and_decode(make_hf_model):
    path, hf = make_hf_model("qwen3")
    toks = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].float()
    table = [9, 3, 7, 1, 5, 0, 2, 4, 6, 8]
    for dtype, atol in ((torch.float32, 1e-3), (torch.bfloat16, 0.15 * ref.abs().max().item())):
        runner = ModelRunner(path, block_size=4, num_kv_blocks=16, device="cuda", dtype=dtype)
        assert runner.device.type == "cuda" and runner.kv_pool.kv.dtype == dtype
        out = runner.execute([RunItem(toks[:21], 0, table)])
        assert out.device.type == "cuda" and out.dtype == torch.float32
        torch.testing.assert_close(out[0].cpu(), ref[20], atol=atol, rtol=0)
        out = runner.execute([RunItem(toks[21:35], 21, table), RunItem([toks[0]], 0, [15])])
        torch.testing.assert_close(out[0].cpu(), ref[34], atol=atol, rtol=0)
        for p in range(35, 40):
            out = runner.execute([RunItem([toks[p]], p, table)])
            torch.testing.assert_close(out[0].cpu(), ref[p], atol=atol, rtol=0)
        gen = make_generator(3, runner.device)
        assert len(sample(out, [SamplingRow(temperature=1.0, top_p=0.9, generator=gen)])) == 1
