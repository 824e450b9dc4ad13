"""Qwen3 (dense): per-head RMSNorm on queries and keys; biases follow ``attention_bias``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixkv.models.config import ArchFlags
from prefixkv.models.llama import LlamaForCausalLM
from prefixkv.models.registry import ModelFamily


def flags(raw: Mapping[str, Any]) -> ArchFlags:
    """q/k norm on; biases follow ``attention_bias``."""
    bias = bool(raw.get("attention_bias", False))
    return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)


FAMILY = ModelFamily(
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    gguf_arch="qwen3",
    flags=flags,
    build=LlamaForCausalLM,
)
