"""GGUF loading: config, weights (dequantized, q/k un-permuted) and tokenizer from the file."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefixkv.models import load_model, load_tokenizer
from prefixkv.models.gguf_file import GGUFFile
from prefixkv.models.gguf_loader import gguf_model_config, hf_name, unpermute_qk
from prefixkv.models.gguf_tokenizer import pre_tokenizer
from prefixkv.models.registry import family_for
from prefixkv.runner import ModelRunner, RunItem

TOKENS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 257, 65, 66, 67] * 2


def _logits(path: Path, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(path, block_size=4, num_kv_blocks=16, device="cpu")
    out = [runner.execute([RunItem(tokens[:5], 0, list(range(16)))])[0]]
    for p in range(5, len(tokens)):  # cached prefix + decode path
        out.append(runner.execute([RunItem([tokens[p]], p, list(range(16)))])[0])
    return torch.stack(out)


def test_demo_gguf_matches_the_safetensors_model(demo_dir: Path, demo_gguf: Path) -> None:
    cfg = gguf_model_config(demo_gguf)
    ref_cfg = load_model(demo_dir, device="cpu").config
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm
    for field in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                  "vocab_size", "rope_theta", "max_position_embeddings"):
        assert getattr(cfg, field) == getattr(ref_cfg, field), field
    torch.testing.assert_close(_logits(demo_gguf, TOKENS), _logits(demo_dir, TOKENS),
                               atol=0, rtol=0)


def test_gguf_tokenizer_and_chat_template(demo_dir: Path, demo_gguf: Path) -> None:
    ours, ref = load_tokenizer(demo_gguf), load_tokenizer(demo_dir)
    text = "Hello, wörld! 123 <|im_start|>user\nhi<|im_end|>"
    assert ours.encode(text) == ref.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 258
    msgs = [{"role": "user", "content": "2+2?"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs)


def _hf_model(kind: str) -> tuple[torch.nn.Module, dict]:
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise / math.sqrt(p.shape[1]) if p.dim() == 2 else 1.0 + 0.1 * noise)
    return model.eval(), common | {"tie_word_embeddings": kind == "qwen2"}


@pytest.mark.parametrize(("kind", "qtype", "atol"), [("llama", "F32", 1e-4), ("qwen2", "F16", 1e-2)])
def test_gguf_matches_transformers(
    tmp_path: Path, gguf_tools, kind: str, qtype: str, atol: float
) -> None:
    """Llama's q/k rows come permuted (llama.cpp's layout) and must be un-permuted; Qwen2 has
    q/k/v biases and tied embeddings."""
    hf, cfg = _hf_model(kind)
    path = gguf_tools.write(tmp_path / f"{kind}.gguf", hf.state_dict(), cfg, kind, qtype=qtype,
                      permute=kind == "llama")
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    ours = _logits(path, TOKENS)
    torch.testing.assert_close(ours, ref[4:], atol=atol, rtol=0)


def test_quantized_weights_are_dequantized(tmp_path: Path, demo_dir: Path, gguf_tools) -> None:
    from safetensors.torch import load_file

    from prefixkv.models.demo import DEMO_CONFIG

    state = load_file(str(demo_dir / "model.safetensors"))
    path = gguf_tools.write(tmp_path / "q8.gguf", state, DEMO_CONFIG, "qwen3", qtype="Q8_0")
    model = load_model(path, device="cpu", dtype="bf16")
    w = model.state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.bfloat16
    ref = state["model.layers.0.mlp.down_proj.weight"]
    assert (w.float() - ref).abs().max() < 0.02 * ref.abs().max()


def test_unpermute_inverts_llama_cpp_permute(gguf_tools) -> None:
    w = torch.randn(24, 5)
    permuted = torch.from_numpy(gguf_tools.permute(w.numpy(), 3))
    assert not torch.equal(permuted, w)
    torch.testing.assert_close(unpermute_qk(permuted, 3), w, atol=0, rtol=0)


def test_names_and_registry() -> None:
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.0.ssm_conv.weight") is None
    assert family_for(gguf_arch="llama").gguf_permuted_qk
    assert not family_for(gguf_arch="qwen2").gguf_permuted_qk


def test_bad_files_and_unsupported_content(tmp_path: Path, demo_dir: Path, gguf_tools) -> None:
    from safetensors.torch import load_file

    from prefixkv.models.demo import DEMO_CONFIG

    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="bad magic"):
        load_model(bad)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(5))
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(trunc)
    state = load_file(str(demo_dir / "model.safetensors"))
    gemma = gguf_tools.write(tmp_path / "gemma.gguf", state, DEMO_CONFIG, "gemma")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        load_model(gemma)
    scaled = gguf_tools.write(tmp_path / "yarn.gguf", state, DEMO_CONFIG, "qwen3",
                        extra={"qwen3.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="RoPE scaling"):
        load_model(scaled)
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
        pre_tokenizer("mystery")


def test_cli_generate_from_a_gguf(demo_gguf: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-m", "prefixkv.cli", "generate", "Hi", "--model", str(demo_gguf),
         "--max-tokens", "3", "--threads", "1", "--json"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert '"finish_reason": "length"' in done.stdout
