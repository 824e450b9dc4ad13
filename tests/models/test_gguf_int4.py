"""``quantization="gguf"``: a GGUF's Q4_0/Q4_1 matmul weights kept at 4 bits (Int4Linear).

Tiny GGUFs written with ``gguf.GGUFWriter`` (conftest); the quantized load is compared with the
dequantized load of the same file (the weights are the same numbers, the int4 kernel computes
in bfloat16). The real SmolLM2 Q4_1 model is covered by ``test_smollm2_int4.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from prefixkv.config import QUANTIZATIONS, EngineConfig
from prefixkv.engine import LLM, SamplingParams
from prefixkv.models import load_model
from prefixkv.models.gguf_loader import QUANTIZATIONS as LOADER_QUANTIZATIONS
from prefixkv.models.llama import Linear
from prefixkv.models.quant_linear import Int4Linear
from prefixkv.runner import ModelRunner, RunItem
from prefixkv.runner.kv_transfer import model_fingerprint

TOKENS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66, 67] * 2
REL_TOL = 3e-2  # of the largest logit: two to four layers of bfloat16 matmuls


def _logits(path: Path, quantization: str | None) -> torch.Tensor:
    runner = ModelRunner(path, block_size=4, num_kv_blocks=16, device="cpu",
                         quantization=quantization)
    out = [runner.execute([RunItem(TOKENS[:5], 0, list(range(16)))])[0]]
    for p in range(5, len(TOKENS)):  # cached prefix + decode path
        out.append(runner.execute([RunItem([TOKENS[p]], p, list(range(16)))])[0])
    return torch.stack(out)


def _hf_state(kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise / p.shape[1] ** 0.5 if p.dim() == 2 else 1.0 + 0.1 * noise)
    return model.state_dict(), common | {"tie_word_embeddings": kind == "qwen2"}


@pytest.mark.parametrize(("kind", "qtype"), [("llama", "Q4_1"), ("qwen2", "Q4_0")])
def test_int4_load_matches_the_dequantized_load(
    tmp_path: Path, gguf_tools, caplog: pytest.LogCaptureFixture, kind: str, qtype: str
) -> None:
    """Llama: q/k rows permuted by llama.cpp are un-permuted in the quantized rows too; Qwen2:
    q/k/v biases kept beside the int4 weight, tied embeddings. Both have a 300-row output or
    embedding table, which cannot be packed (rows % 16) and is dequantized with a warning."""
    state, cfg = _hf_state(kind)
    path = gguf_tools.write(tmp_path / f"{kind}.gguf", state, cfg, kind, qtype=qtype,
                            permute=kind == "llama")
    with caplog.at_level(logging.WARNING, logger="prefixkv.models.gguf_loader"):
        model = load_model(path, device="cpu", quantization="gguf")
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]  # type: ignore[attr-defined]
    assert len(layers) == 4 * cfg["num_hidden_layers"]
    assert "dequantized instead of kept quantized" in caplog.text and qtype in caplog.text
    if kind == "qwen2":
        assert layers[0].bias is not None  # the fused q/k/v bias
    else:  # the untied output layer has 300 rows: a plain Linear
        assert isinstance(model.lm_head, Linear)  # type: ignore[attr-defined]
    want, got = _logits(path, None), _logits(path, "gguf")
    err = (got - want).abs().max().item()
    assert err <= REL_TOL * want.abs().max().item(), err
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_demo_model_q4_greedy_identical_with_and_without_the_cache(
    tmp_path: Path, demo_dir: Path, gguf_tools
) -> None:
    from safetensors.torch import load_file

    from prefixkv.models.demo import DEMO_CONFIG

    state = load_file(str(demo_dir / "model.safetensors"))
    path = gguf_tools.write(tmp_path / "q4.gguf", state, DEMO_CONFIG, "qwen3", qtype="Q4_1")
    prompts = [list(range(40, 40 + 37)) + [i] for i in range(3)]  # a shared 37-token prefix
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for caching in (True, False):
        llm = LLM(str(path), quantization="gguf", device="cpu", num_kv_blocks=64,
                  enable_prefix_caching=caching)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])  # warm
    assert runs[0] == runs[1] == runs[2] == runs[3]
    assert any(isinstance(m, Int4Linear) for m in llm.engine.runner.model.modules())  # type: ignore[attr-defined]


def test_fingerprint_tells_the_int4_model_from_the_dequantized_one(demo_gguf: Path, tmp_path: Path,
                                                                   demo_dir: Path, gguf_tools) -> None:
    from safetensors.torch import load_file

    from prefixkv.models.demo import DEMO_CONFIG

    state = load_file(str(demo_dir / "model.safetensors"))
    path = gguf_tools.write(tmp_path / "q4.gguf", state, DEMO_CONFIG, "qwen3", qtype="Q4_0")
    plain, quant = load_model(path, device="cpu"), load_model(path, device="cpu", quantization="gguf")
    assert model_fingerprint(plain) != model_fingerprint(quant)  # their KV must never mix
    assert model_fingerprint(quant) == model_fingerprint(load_model(path, quantization="gguf",
                                                                    device="cpu"))


def test_bad_quantization_settings_name_the_argument(demo_dir: Path, demo_gguf: Path) -> None:
    assert QUANTIZATIONS == LOADER_QUANTIZATIONS
    with pytest.raises(ValueError, match="quantization must be one of gguf"):
        EngineConfig.from_kwargs(quantization="awq")
    with pytest.raises(ValueError, match="quantization must be one of gguf"):
        load_model(demo_gguf, quantization="awq")
    with pytest.raises(ValueError, match="quantization='gguf' runs on CPU only"):
        load_model(demo_gguf, device="cuda", quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model"):
        load_model(demo_dir, quantization="gguf")
    assert EngineConfig.from_kwargs(quantization="gguf").model.quantization == "gguf"
    assert EngineConfig().model.quantization is None


def test_serve_flag(demo_gguf: Path) -> None:
    import argparse

    from prefixkv.cli.flags import add_engine_flags, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_kwargs(p.parse_args([str(demo_gguf), "--quantization", "gguf"]))["quantization"] == "gguf"
    assert engine_kwargs(p.parse_args([str(demo_gguf)]))["quantization"] is None
    with pytest.raises(SystemExit):
        p.parse_args([str(demo_gguf), "--quantization", "awq"])
