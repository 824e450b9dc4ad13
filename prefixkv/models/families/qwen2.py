"""Qwen2 / Qwen2.5: bias on q/k/v (never on o), no q/k norm."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixkv.models.config import ArchFlags
from prefixkv.models.llama import LlamaForCausalLM
from prefixkv.models.registry import ModelFamily


def flags(raw: Mapping[str, Any]) -> ArchFlags:
    """q/k/v always carry a bias, o never (whatever ``attention_bias`` says)."""
    return ArchFlags(qkv_bias=True, o_bias=False, qk_norm=False)


FAMILY = ModelFamily(
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    gguf_arch="qwen2",
    flags=flags,
    build=LlamaForCausalLM,
)
