"""llama.cpp's GGUF LoRA adapters (issue 44): a PEFT adapter converted the way
``convert_lora_to_gguf.py`` converts it loads to the same weights (the same digest) and gives
the same greedy tokens, on the demo model (Qwen3 layout) and on SmolLM2 (Llama: q/k rows
permuted in the file); ``--lora-modules`` and the runtime load take the file; a file that is
not a LoRA for this model is a ``ValueError`` naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prefixkv.engine import LLM, SamplingParams
from prefixkv.engine.lora import LoRARequest
from prefixkv.models.demo import DEMO_CONFIG

gguf = pytest.importorskip("gguf")
from gguf_lora_writer import write_gguf_lora  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = list(range(65, 65 + 40))


def random_peft(out: Path, shapes: dict[str, tuple[int, int]], layers: int, rank: int,
                seed: int) -> Path:
    """A PEFT-format LoRA (safetensors + config) with random weights on ``shapes``
    (projection -> (in, out)) of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for proj, (fan_in, fan_out) in shapes.items():
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes),
        "bias": "none"}))
    return out


def demo_shapes() -> dict[str, tuple[int, int]]:
    c = DEMO_CONFIG
    h, d = c["hidden_size"], c["head_dim"]
    q, kv, inter = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def test_a_gguf_lora_is_its_peft_adapter_on_the_demo_model(demo_dir: Path, tmp_path: Path) -> None:
    peft_dir = random_peft(tmp_path / "peft", demo_shapes(), DEMO_CONFIG["num_hidden_layers"], 8, 1)
    layers = DEMO_CONFIG["num_hidden_layers"]
    f32 = write_gguf_lora(peft_dir, tmp_path / "a-f32.gguf", "qwen3", layers)
    f16 = write_gguf_lora(peft_dir, tmp_path / "a-f16.gguf", "qwen3", layers, qtype="F16")
    with LLM(demo_dir, dtype="float32", num_kv_blocks=128, enable_lora=True,
             lora_modules=[f"peft={peft_dir}", f"gguf={f32}"]) as llm:
        reg = llm.engine.lora
        assert reg is not None
        assert reg.resolve("gguf").digest == reg.resolve("peft").digest  # the same weights
        outs = llm.generate([PROMPT] * 3, GREEDY, lora_request=["peft", "gguf", None])
        peft_ids, gguf_ids, base_ids = (o.outputs[0].token_ids for o in outs)
        assert gguf_ids == peft_ids != base_ids
        # runtime load (vLLM's /v1/load_lora_adapter calls this), float16 tensors: other
        # weights (rounded), so another digest, and still the adapter
        reg.add("half", f16)
        assert reg.resolve("half").digest != reg.resolve("peft").digest
        half = llm.generate(PROMPT, GREEDY, lora_request="half")[0].outputs[0].token_ids
        assert half != base_ids
        via_request = llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("g2", 9, str(f32)))
        assert via_request[0].outputs[0].token_ids == peft_ids


def test_files_that_are_not_a_lora_for_this_model_are_refused(
        demo_dir: Path, demo_gguf: Path, tmp_path: Path) -> None:
    peft_dir = random_peft(tmp_path / "peft", {"q_proj": (256, 256)}, 1, 4, 2)
    wrong_arch = write_gguf_lora(peft_dir, tmp_path / "llama.gguf", "llama", 1, heads=4, kv_heads=2)
    big = random_peft(tmp_path / "big", {"v_proj": (256, 128)}, 1, 16, 3)
    big_gguf = write_gguf_lora(big, tmp_path / "big.gguf", "qwen3", 1)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with LLM(demo_dir, dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8) as llm:
        reg = llm.engine.lora
        assert reg is not None
        for path, words in ((demo_gguf, "general.type"), (wrong_arch, "general.architecture"),
                            (big_gguf, "max-lora-rank"), (garbage, "not a PEFT directory")):
            with pytest.raises(ValueError, match=words):
                reg.add("bad", path)
        assert "bad" not in reg
        assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids  # the engine is fine


@pytest.mark.slow
def test_a_gguf_lora_on_smollm2_undoes_llama_cpps_qk_permutation(smol: Path, tmp_path: Path) -> None:
    from prefixkv.models.gguf_loader import gguf_model_config

    c = gguf_model_config(smol)
    h, d = c.hidden_size, c.head_dim
    shapes = {"q_proj": (h, c.num_attention_heads * d), "k_proj": (h, c.num_key_value_heads * d),
              "v_proj": (h, c.num_key_value_heads * d), "down_proj": (c.intermediate_size, h)}
    peft_dir = random_peft(tmp_path / "peft", shapes, c.num_hidden_layers, 4, 4)
    path = write_gguf_lora(peft_dir, tmp_path / "smol-lora.gguf", "llama", c.num_hidden_layers,
                           heads=c.num_attention_heads, kv_heads=c.num_key_value_heads)
    with LLM(str(smol), dtype="float32", num_kv_blocks=64, enable_lora=True,
             lora_modules=[f"peft={peft_dir}", f"gguf={path}"]) as llm:
        reg = llm.engine.lora
        assert reg is not None
        assert reg.resolve("gguf").digest == reg.resolve("peft").digest
        outs = llm.generate([PROMPT] * 3, GREEDY, lora_request=["peft", "gguf", None])
    peft_ids, gguf_ids, base_ids = (o.outputs[0].token_ids for o in outs)
    assert gguf_ids == peft_ids != base_ids
