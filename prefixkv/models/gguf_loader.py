"""Load a GGUF file (llama.cpp's format) into a registry family's model.

The config comes from the ``<arch>.*`` metadata, the weights from the tensors, dequantized
with the ``gguf`` package (any type it knows: F32/F16/BF16, Q4_0/Q4_1/Q5_x/Q8_0, K-quants)
and cast to the engine's dtype. GGUF names (``blk.N.attn_q.weight``) are mapped back to Hugging
Face names; for families whose q/k rows llama.cpp's converter permuted (Llama), the permutation
is reversed, exactly as transformers' GGUF loader does, so logits match it.

Rejected with ``ValueError``: architectures the registry lacks, partial rotary embeddings,
RoPE scaling (``rope_freqs`` tensors or a scaling type), tensor types ``gguf`` cannot dequantize.

``quantization="gguf"`` (vLLM's name) keeps the Q4_0 / Q4_1 matmul weights at 4 bits
(:mod:`prefixkv.models.quant_linear`, CPU only): their :class:`~prefixkv.models.llama.Linear`
modules are replaced by :class:`~prefixkv.models.quant_linear.Int4Linear` after loading, fused
q/k/v and gate/up kept fused. Everything else is dequantized as without it, with one warning
naming the quantized tensors that had to be (other types: no exact CPU kernel, e.g. Q8_0 is
per-32-group int8 and torch's int8 kernel has one scale per row; the embedding table, whose
lookups need the plain rows, and so a tied output layer).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixkv.models.config import ModelConfig
from prefixkv.models.gguf_file import GGUFFile, GGUFTensor
from prefixkv.models.llama import PACKED_WEIGHTS, CausalLM, Linear
from prefixkv.models.loader import build_model, resolve_device
from prefixkv.models.quant_linear import Int4Linear, Q4Rows, decode_q4, int4_unsupported
from prefixkv.models.registry import family_for

logger = logging.getLogger(__name__)
QUANTIZATIONS = ("gguf",)
"""Values of ``quantization`` (``None``: dequantize every tensor to the engine dtype)."""
_PLAIN_TYPES = {0, 1, 30}  # F32, F16, BF16: nothing to keep quantized

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


def _linear_target(name: str) -> tuple[str, int, int] | None:
    """HF weight name -> (our Linear module, part index, parts) for matmul weights, else ``None``."""
    if not name.endswith(".weight") or not (name.endswith("_proj.weight") or name == "lm_head.weight"):
        return None
    module = name.removesuffix(".weight")
    for hf, (ours, index, parts) in PACKED_WEIGHTS.items():
        if module.endswith(f".{hf}"):
            return module.removesuffix(hf) + ours, index, parts
    return module, 0, 1


def plan_int4(file: GGUFFile, device: torch.device) -> dict[str, tuple[int, int]]:
    """Our Linear modules whose every part can stay at 4 bits -> fused ``(rows, cols)``.

    Logs one warning listing the quantized tensors that will be dequantized instead, and why.
    """
    parts: dict[str, dict[int, GGUFTensor]] = {}
    counts: dict[str, int] = {}
    for tensor in file.tensors:
        name = hf_name(tensor.name)
        target = None if name is None else _linear_target(name)
        if target is not None:
            parts.setdefault(target[0], {})[target[1]] = tensor
            counts[target[0]] = target[2]
    keep: dict[str, tuple[int, int]] = {}
    fallback: Counter[str] = Counter()
    for module, got in parts.items():
        reasons = {int4_unsupported(t.tensor_type, t.shape, device) for t in got.values()}
        if reasons == {None} and len(got) == counts[module]:
            ordered = [got[i] for i in range(counts[module])]
            keep[module] = (sum(t.shape[0] for t in ordered), ordered[0].shape[1])
    for tensor in file.tensors:
        name = hf_name(tensor.name)
        target = None if name is None else _linear_target(name)
        if tensor.tensor_type in _PLAIN_TYPES or (target is not None and target[0] in keep):
            continue
        from gguf.constants import GGMLQuantizationType

        if target is None:
            why = "not a matmul weight (the embedding table: lookups read plain rows)"
        else:
            why = (int4_unsupported(tensor.tensor_type, tensor.shape, device)
                   or "fused with a part that cannot stay at 4 bits")
        fallback[f"{GGMLQuantizationType(tensor.tensor_type).name} ({why})"] += 1
    if fallback:
        listed = "; ".join(f"{n} x {k}" for k, n in sorted(fallback.items()))
        logger.warning("quantization='gguf': dequantized instead of kept quantized: %s", listed)
    return keep


def _tensors(
    file: GGUFFile, config: ModelConfig, permuted: bool, keep: dict[str, tuple[int, int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    placed: set[str] = set()
    for tensor in file.tensors:
        name = hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue  # rejected by hf_config already
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
        target = _linear_target(name)
        if target is not None and target[0] in keep:
            if target[0] not in placed:  # the fused weight, as a meta placeholder
                placed.add(target[0])
                yield f"{target[0]}.weight", torch.empty(keep[target[0]], device="meta")
            continue
        value = _dequantize(tensor)
        if permuted and ".self_attn.q_proj." in name:
            value = unpermute_qk(value, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            value = unpermute_qk(value, config.num_key_value_heads)
        yield name, value


def _attach_int4(
    model: torch.nn.Module, file: GGUFFile, config: ModelConfig, permuted: bool,
    keep: dict[str, tuple[int, int]],
) -> None:
    """Replace each kept Linear by an :class:`Int4Linear` made from its raw GGUF parts."""
    parts: dict[str, dict[int, Q4Rows]] = {}
    for tensor in file.tensors:
        name = hf_name(tensor.name)
        target = None if name is None else _linear_target(name)
        if name is None or target is None or target[0] not in keep:
            continue
        rows = decode_q4(tensor.tensor_type, tensor.data)
        heads = {".self_attn.q_proj.": config.num_attention_heads,
                 ".self_attn.k_proj.": config.num_key_value_heads}
        for key, n in heads.items():
            if permuted and key in name:
                rows = Q4Rows(*(unpermute_qk(t, n) for t in (rows.q, rows.scale, rows.zero)))
        parts.setdefault(target[0], {})[target[1]] = rows
    for module, got in parts.items():
        parent, _, attr = module.rpartition(".")
        plain = model.get_submodule(module)  # loaded by build_model: its bias has data
        if not isinstance(plain, Linear):
            raise TypeError(f"{module} is a {type(plain).__name__}, not a Linear")
        layer = Int4Linear.from_rows([got[i] for i in range(len(got))], plain.bias)
        setattr(model.get_submodule(parent) if parent else model, attr, layer)


def gguf_model_config(path: str | Path) -> ModelConfig:
    """The resolved :class:`ModelConfig` of a GGUF file (reads metadata only)."""
    file = GGUFFile(path)
    return ModelConfig.from_dict(hf_config(file.metadata, {t.name for t in file.tensors}))


def load_gguf_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """The model in the GGUF file ``path`` on ``device``, eval mode: dequantized to ``dtype``,
    or with ``quantization="gguf"`` its Q4_0/Q4_1 matmul weights kept at 4 bits (CPU only;
    ``ValueError`` naming ``quantization`` for another value or device)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, "
                         f"got {quantization!r}")
    # The device type is checked before CUDA's availability, so the message names quantization.
    kind = "cuda" if device is None and torch.cuda.is_available() else str(device or "cpu")
    if quantization == "gguf" and not kind.startswith("cpu"):
        raise ValueError(f"quantization='gguf' runs on CPU only (torch's int4 CPU kernel), "
                         f"got device {kind!r}")
    dev = resolve_device(device)
    file = GGUFFile(path)
    raw = hf_config(file.metadata, {t.name for t in file.tensors})
    config = ModelConfig.from_dict(raw)
    permuted = family_for(architecture=config.architecture).gguf_permuted_qk
    keep = plan_int4(file, dev) if quantization == "gguf" else {}
    model = build_model(
        config, _tensors(file, config, permuted, keep), device=dev, dtype=dtype, source=str(path)
    )
    if keep:
        _attach_int4(model, file, config, permuted, keep)  # type: ignore[arg-type]
    return model
