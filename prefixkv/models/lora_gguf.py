"""llama.cpp's GGUF LoRA adapters (what its ``convert_lora_to_gguf.py`` writes), read for
:func:`~prefixkv.models.lora.load_adapter`.

The file: ``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``
(float; missing or 0: scale 1, else ``alpha / rank`` per weight, as llama.cpp's
``llama_adapter_lora_weight::get_scale``), ``general.architecture`` the base model's, and per
targeted weight a pair ``blk.N.<proj>.weight.lora_a`` ``[r, in]`` / ``.lora_b`` ``[out, r]``
(numpy order) named like the base weight. Types: anything the ``gguf`` package dequantizes
(F32, F16, BF16, Q8_0). For families whose q/k rows llama.cpp permutes (Llama), ``lora_b`` of q
and k carries that permutation too (``lora_a`` does not); it is reversed here as the base
weights' is, so the pairs come back in Hugging Face's layout.

Refused (``ValueError`` naming it): another file type or adapter type, another architecture,
aLoRA invocation tokens, tensors that are not a pair on a decoder projection (the token
embedding, the output layer, mergekit's extra norms), a layer past the model's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from prefixkv.models.config import ModelConfig
from prefixkv.models.gguf_file import GGUFFile, GGUFTensor
from prefixkv.models.gguf_loader import hf_name, unpermute_qk
from prefixkv.models.registry import family_for

__all__ = ["read_gguf_lora"]


def _dequantize(tensor: GGUFTensor) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    except (NotImplementedError, ValueError) as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {exc}") from exc
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(tensor.shape))


def read_gguf_lora(path: str | Path, config: ModelConfig
                   ) -> tuple[dict[tuple[int, str], dict[str, torch.Tensor]], float]:
    """The pairs ``{(layer, hf projection): {"a": [r, in], "b": [out, r]}}`` (float32, HF
    layout, unscaled) and ``adapter.lora.alpha`` (0.0 when absent) of the GGUF LoRA ``path``
    for a model of ``config``."""
    where = f"lora adapter {str(path)!r}"
    try:
        file = GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: not a PEFT directory or a readable GGUF file ({exc})") from None
    meta = file.metadata
    family = family_for(architecture=config.architecture)
    problems = []
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        problems.append(f"general.type {meta.get('general.type')!r} / adapter.type "
                        f"{meta.get('adapter.type')!r} (a LoRA adapter is 'adapter' / 'lora')")
    if meta.get("general.architecture") != family.gguf_arch:
        problems.append(f"general.architecture {meta.get('general.architecture')!r}, the model "
                        f"is {family.gguf_arch!r}")
    if meta.get("adapter.alora.invocation_tokens"):
        problems.append("aLoRA invocation tokens")
    if problems:
        raise ValueError(f"{where} is not supported: " + "; ".join(problems))
    alpha = float(meta.get("adapter.lora.alpha") or 0.0)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in file.tensors:
        base, _, which = tensor.name.rpartition(".")
        hf = hf_name(base) if which in ("lora_a", "lora_b") else None
        parts = hf.split(".") if hf is not None and hf.startswith("model.layers.") else []
        if len(parts) != 6 or not parts[4].endswith("_proj") or parts[5] != "weight":
            raise ValueError(f"{where}: tensor {tensor.name!r} is not a LoRA pair on a decoder "
                             "layer projection (embeddings, the output layer and norms are not "
                             "supported)")
        layer, proj = int(parts[2]), parts[4]
        if not 0 <= layer < config.num_hidden_layers:
            raise ValueError(f"{where}: tensor {tensor.name!r} is past the model's "
                             f"{config.num_hidden_layers} layers")
        value = _dequantize(tensor)
        if which == "lora_b" and family.gguf_permuted_qk and proj in heads:
            value = unpermute_qk(value, heads[proj])
        pairs.setdefault((layer, proj), {})["a" if which == "lora_a" else "b"] = value
    return pairs, alpha
