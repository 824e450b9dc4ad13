"""The model registry: architecture name -> family (config adapter, model class, GGUF names).

A family is one small module under :mod:`prefixkv.models.families` defining a
:class:`ModelFamily`; adding an architecture is that file plus one line in :data:`FAMILIES`.
Lookups go by the Hugging Face architecture (``config.json``'s ``architectures[0]``), by its
``model_type``, or by a GGUF file's ``general.architecture``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixkv.models.config import ArchFlags, ModelConfig
    from prefixkv.models.llama import CausalLM


@dataclass(slots=True, frozen=True)
class ModelFamily:
    """One supported architecture.

    ``flags(raw)`` turns a raw HF config dict into the architecture-specific switches of
    :class:`~prefixkv.models.config.ModelConfig` (biases, q/k norm). ``build(config)`` makes the
    model with uninitialised weights. ``gguf_arch`` is the GGUF ``general.architecture`` name;
    ``gguf_permuted_qk``: llama.cpp's converter reorders q/k rows of this family for its
    interleaved RoPE, so the GGUF loader reverses that.
    """

    architecture: str
    model_type: str
    gguf_arch: str
    flags: Callable[[Mapping[str, Any]], ArchFlags]
    build: Callable[[ModelConfig], CausalLM]
    gguf_permuted_qk: bool = False


def _families() -> tuple[ModelFamily, ...]:
    from prefixkv.models.families import llama, qwen2, qwen3

    return (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY)  # one line per family


_CACHE: list[tuple[ModelFamily, ...]] = []


def families() -> tuple[ModelFamily, ...]:
    """Every registered family (imported on first use, so the config module stays light)."""
    if not _CACHE:
        _CACHE.append(_families())
    return _CACHE[0]


def supported_architectures() -> tuple[str, ...]:
    """The HF architecture names we load, in registry order."""
    return tuple(f.architecture for f in families())


def family_for(
    *, architecture: str | None = None, model_type: str | None = None, gguf_arch: str | None = None
) -> ModelFamily:
    """The family matching the one given name; ``ValueError`` listing what is supported."""
    for f in families():
        if (
            (architecture is not None and f.architecture == architecture)
            or (model_type is not None and f.model_type == model_type)
            or (gguf_arch is not None and f.gguf_arch == gguf_arch)
        ):
            return f
    if gguf_arch is not None:
        known = ", ".join(f.gguf_arch for f in families())
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r} (supported: {known})")
    name = architecture if architecture is not None else f"model_type={model_type!r}"
    raise ValueError(
        f"unsupported model architecture {name!r} "
        f"(supported: {', '.join(supported_architectures())})"
    )
