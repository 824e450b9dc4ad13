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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_cuda_engine_greedy_identical_with_and_without_cache(tmp_path, dtype, policy):
    """The engine's equivalence contract on CUDA: prefix caching never changes greedy tokens."""
    from prefixkv.engine import LLM, SamplingParams
    from prefixkv.models.demo import ensure_demo_model

    model = ensure_demo_model(tmp_path)
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(32, 127, (70,), generator=gen).tolist()
    prompts = [system + torch.randint(32, 127, (5 + i,), generator=gen).tolist() for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        llm = LLM(model, device="cuda", dtype=dtype, num_kv_blocks=48, block_size=16,
                  enable_prefix_caching=caching, schedule_policy=policy)
        assert llm.engine.runner.kv_pool.kv.device.type == "cuda"
        first = llm.generate(prompts[:1], params)
        rest = llm.generate(prompts, params)
        if caching:
            assert all(o.num_cached_tokens >= 64 for o in rest)
        outs[caching] = [o.outputs[0].token_ids for o in first + rest]
    assert outs[True] == outs[False]


def test_cuda_gguf_matches_cpu(tmp_path):
    """A GGUF loads straight onto the GPU; fp32 logits agree with the CPU run."""
    from safetensors.torch import load_file

    from prefixkv.models.demo import DEMO_CONFIG, ensure_demo_model
    from prefixkv.models.gguf_file import GGUFFile

    demo = ensure_demo_model(tmp_path)
    gguf = pytest.importorskip("gguf")  # the module, for its writer
    path = tmp_path / "demo.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    c = DEMO_CONFIG
    for add, value in ((w.add_block_count, c["num_hidden_layers"]),
                       (w.add_context_length, c["max_position_embeddings"]),
                       (w.add_embedding_length, c["hidden_size"]),
                       (w.add_feed_forward_length, c["intermediate_size"]),
                       (w.add_head_count, c["num_attention_heads"]),
                       (w.add_head_count_kv, c["num_key_value_heads"]),
                       (w.add_key_length, c["head_dim"]), (w.add_rope_dimension_count, c["head_dim"]),
                       (w.add_rope_freq_base, c["rope_theta"]), (w.add_layer_norm_rms_eps, c["rms_norm_eps"])):
        add(value)
    from prefixkv.models.demo import SPECIAL_TOKENS, _bytes_to_unicode

    chars = _bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chars[b] for b in range(256)] + list(SPECIAL_TOKENS))
    w.add_token_types([1] * 256 + [3] * len(SPECIAL_TOKENS))
    w.add_token_merges([])
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in load_file(str(demo / "model.safetensors")).items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            out = f"blk.{layer}.{names[rest]}.{kind}"
        else:
            out = f"{names[stem]}.{kind}"
        w.add_tensor(out, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert len(GGUFFile(path).tensors) > 0
    toks = list(range(60, 90))
    logits = []
    for device in ("cpu", "cuda"):
        runner = ModelRunner(path, block_size=4, num_kv_blocks=16, device=device, dtype="float32")
        logits.append(runner.execute([RunItem(toks, 0, list(range(16)))])[0].cpu())
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=0)
