"""Load a GGUF file (llama.cpp's format) into a registry family's model.

The config comes from the ``<arch>.*`` metadata, the weights from the tensors, dequantized
with the ``gguf`` package (any type it knows: F32/F16/BF16, Q4_0/Q4_1/Q5_x/Q8_0, K-quants)
and cast to the engine's dtype. GGUF names (``blk.N.attn_q.weight``) are mapped back to Hugging
Face names; for families whose q/k rows llama.cpp's converter permuted (Llama), the permutation
is reversed, exactly as transformers' GGUF loader does, so logits match it.

Rejected with ``ValueError``: architectures the registry lacks, partial rotary embeddings,
RoPE scaling (``rope_freqs`` tensors or a scaling type), tensor types ``gguf`` cannot dequantize.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixkv.models.config import ModelConfig
from prefixkv.models.gguf_file import GGUFFile, GGUFTensor
from prefixkv.models.llama import CausalLM
from prefixkv.models.loader import build_model, resolve_device
from prefixkv.models.registry import family_for

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """An HF ``config.json``-style dict from GGUF metadata; ``ValueError`` for what we lack."""
    arch = str(meta.get("general.architecture"))
    family = family_for(gguf_arch=arch)

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"unsupported GGUF: rope.dimension_count={rot} != head_dim={head_dim}")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"unsupported GGUF: RoPE scaling ({scaling or 'rope_freqs tensor'})")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    bias = "blk.0.attn_output.bias" in tensor_names or "blk.0.attn_q.bias" in tensor_names
    return {
        "architectures": [family.architecture],
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": bias,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
    }


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF name (``None`` for tensors we do not use)."""
    m = _LAYER.match(name)
    if m:
        layer, part, kind = m.groups()
        target = _LAYER_NAMES.get(part)
        return None if target is None else f"model.layers.{layer}.{target}.{kind}"
    stem, _, kind = name.rpartition(".")
    target = _GLOBAL_NAMES.get(stem)
    return None if target is None else f"{target}.{kind}"


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> HF's rotate-half layout)."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _dequantize(tensor: GGUFTensor) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {exc}") from exc
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(tensor.shape))


def _tensors(
    file: GGUFFile, config: ModelConfig, permuted: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in file.tensors:
        name = hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue  # rejected by hf_config already
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
        value = _dequantize(tensor)
        if permuted and ".self_attn.q_proj." in name:
            value = unpermute_qk(value, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            value = unpermute_qk(value, config.num_key_value_heads)
        yield name, value


def gguf_model_config(path: str | Path) -> ModelConfig:
    """The resolved :class:`ModelConfig` of a GGUF file (reads metadata only)."""
    file = GGUFFile(path)
    return ModelConfig.from_dict(hf_config(file.metadata, {t.name for t in file.tensors}))


def load_gguf_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> CausalLM:
    """The model in the GGUF file ``path``, dequantized to ``dtype`` on ``device``, eval mode."""
    file = GGUFFile(path)
    raw = hf_config(file.metadata, {t.name for t in file.tensors})
    config = ModelConfig.from_dict(raw)
    permuted = family_for(architecture=config.architecture).gguf_permuted_qk
    return build_model(
        config,
        _tensors(file, config, permuted),
        device=resolve_device(device),
        dtype=dtype,
        source=str(path),
    )
