"""Model layer: Llama-family decoder, HF-format loader, tokenizer and the built-in demo model.

Imports nothing from the upper layers; the runner passes its paged attention in through
``LlamaForCausalLM.forward``.
"""

from prefixkv.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from prefixkv.models.demo import ensure_demo_model
from prefixkv.models.llama import LlamaForCausalLM
from prefixkv.models.loader import load_model, resolve_device, resolve_dtype
from prefixkv.models.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "ModelConfig",
    "Tokenizer",
    "ensure_demo_model",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]
