"""Model configuration: a resolved, validated view of a Hugging Face ``config.json``.

Architectures come from :mod:`prefixkv.models.registry` (Llama, Qwen2, Qwen3); each family
supplies its own switches (:class:`ArchFlags`). Both the classic layout (``rope_theta`` + ``rope_scaling``, ``torch_dtype``)
and the transformers >= 5 layout (``rope_parameters``, ``dtype``) are read. Anything that would
change the maths and that we do not implement (sliding windows, MLP biases, RoPE scaling other
than ``llama3``) is rejected with a ``ValueError`` naming it, never silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True, frozen=True)
class ArchFlags:
    """The architecture-specific switches a family derives from a raw config."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


@dataclass(slots=True, frozen=True)
class Llama3RopeScaling:
    """The ``rope_type: "llama3"`` frequency scaling (Llama 3.1+)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Everything the decoder needs, fully resolved (no optional lookups at run time).

    ``qkv_bias`` / ``o_bias``: whether q/k/v and o projections carry a bias (Qwen2: q/k/v only;
    Llama and Qwen3: both follow ``attention_bias``). ``qk_norm``: Qwen3's per-head RMSNorm on
    queries and keys. ``eos_token_ids`` may hold several ids (``eos_token_id`` can be a list).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    rope_scaling: Llama3RopeScaling | None = None

    @property
    def attention_bias(self) -> bool:
        """True when the q/k/v projections have a bias (HF's name for it)."""
        return self.qkv_bias

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Resolve an HF ``config.json`` dict; ``ValueError`` naming any unsupported field."""
        from prefixkv.models.registry import family_for

        archs = raw.get("architectures") or []
        family = (
            family_for(architecture=str(archs[0]))
            if archs
            else family_for(model_type=str(raw.get("model_type")))
        )
        arch, flags = family.architecture, family.flags(raw)
        if raw.get("use_sliding_window"):
            raise ValueError("unsupported config: use_sliding_window=true")
        if raw.get("mlp_bias"):
            raise ValueError("unsupported config: mlp_bias=true")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported config: hidden_act={act!r} (only 'silu')")

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ValueError(f"config.json lacks required field {key!r}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        rope_theta, scaling = _rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else (() if eos is None else (int(eos),))
        )
        bos = raw.get("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=flags.qkv_bias,
            o_bias=flags.o_bias,
            qk_norm=flags.qk_norm,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            rope_scaling=scaling,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read and resolve ``path`` (a ``config.json`` file or the directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        with path.open(encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _rope(raw: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either config layout; rejects unsupported scaling types."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = params
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
    if (
        float((scaling or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        != 1.0
    ):
        raise ValueError("unsupported config: partial_rotary_factor != 1")
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")
    return theta, Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
