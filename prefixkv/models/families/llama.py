"""Llama (Llama 2/3, SmolLM, ...): ``attention_bias`` on q/k/v/o alike, no q/k norm."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixkv.models.config import ArchFlags
from prefixkv.models.llama import LlamaForCausalLM
from prefixkv.models.registry import ModelFamily


def flags(raw: Mapping[str, Any]) -> ArchFlags:
    """q/k/v and o biases both follow ``attention_bias``."""
    bias = bool(raw.get("attention_bias", False))
    return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=False)


FAMILY = ModelFamily(
    architecture="LlamaForCausalLM",
    model_type="llama",
    gguf_arch="llama",
    flags=flags,
    build=LlamaForCausalLM,
    gguf_permuted_qk=True,
)
