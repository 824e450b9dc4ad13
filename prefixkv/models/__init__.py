"""Model layer: Llama-family decoders, the model registry, HF-directory and GGUF loaders,
tokenizers, the built-in demo model and named real models (:mod:`prefixkv.models.catalog`).

Imports nothing from the upper layers; the runner passes its paged attention in through
``CausalLM.__call__``.
"""

from prefixkv.models.config import ModelConfig
from prefixkv.models.demo import ensure_demo_model
from prefixkv.models.llama import CausalLM, LlamaForCausalLM
from prefixkv.models.loader import load_model, load_tokenizer, resolve_device, resolve_dtype
from prefixkv.models.registry import ModelFamily, family_for, supported_architectures
from prefixkv.models.tokenizer import IncrementalDetokenizer, Tokenizer

SUPPORTED_ARCHITECTURES = supported_architectures()

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelFamily",
    "Tokenizer",
    "ensure_demo_model",
    "family_for",
    "load_model",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "supported_architectures",
]
