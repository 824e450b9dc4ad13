"""Tiny randomly initialised ``transformers`` models saved in HF format (the reference)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from prefixkv.models.demo import build_byte_tokenizer

COMMON = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}
ARCHS: dict[str, tuple[str, str, dict]] = {
    # Llama: llama3 rope scaling, untied head.
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # Qwen2: q/k/v bias, tied embeddings.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1e6, "tie_word_embeddings": True}),
    # Qwen3: q/k norm, head_dim != hidden / heads.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "rope_theta": 1e6}),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are O(1) (HF's 0.02 init makes the check too easy)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                p.copy_(noise / math.sqrt(p.shape[1]) * (4.0 if "embed" in name else 1.0))
            elif name.endswith("bias"):
                p.copy_(noise * 0.1)
            else:  # norm weights
                p.copy_(1.0 + 0.1 * noise)


@pytest.fixture
def make_hf_model(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """``make_hf_model(arch, shard=False, **config) -> (model_dir, hf_model)``; dir has a
    tokenizer too; ``config`` overrides the tiny defaults (``COMMON``)."""

    def make(
        arch: str, *, shard: bool = False, seed: int = 0, **overrides: object
    ) -> tuple[Path, torch.nn.Module]:
        cfg_name, model_name, extra = ARCHS[arch]
        config = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config).eval()
        _randomize(model, seed)
        path = tmp_path / f"{arch}-{'sharded' if shard else 'single'}"
        kwargs = {"max_shard_size": "40KB"} if shard else {}
        model.save_pretrained(path, safe_serialization=True, **kwargs)
        build_byte_tokenizer().save(str(path / "tokenizer.json"))
        return path, model

    return make
