"""prefixkv: prefix caching for LLM inference.

The cache core (``prefixkv.cache``) and :class:`EngineConfig` are pure Python and imported
eagerly. The engine layer (``LLM``, ``SamplingParams``, ...) imports torch, so it is loaded
lazily on first use: importing ``prefixkv`` or ``prefixkv.cache`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from prefixkv.cache import (
    BlockPool,
    CacheStats,
    EvictionPolicy,
    FIFOPolicy,
    GhostPolicy,
    HashPrefixCache,
    LFUPolicy,
    LRUPolicy,
    PinError,
    PinnedPrefix,
    PrefixCache,
    PrefixMatch,
    PrefixNode,
    RadixPrefixCache,
    Retention,
    RetentionError,
    make_cache,
    make_policy,
)
from prefixkv.config import CacheSettings, EngineConfig, ModelSettings, SchedulerSettings

__version__ = "0.1.0"

# name -> module for the torch-dependent public API (resolved on first attribute access)
_LAZY = {
    "LLM": "prefixkv.engine",
    "SamplingParams": "prefixkv.engine",
    "RequestOutput": "prefixkv.engine",
    "CompletionOutput": "prefixkv.engine",
    "AsyncEngine": "prefixkv.engine",
    "EngineStats": "prefixkv.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "LLM",
    "AsyncEngine",
    "BlockPool",
    "CacheSettings",
    "CacheStats",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "EvictionPolicy",
    "FIFOPolicy",
    "GhostPolicy",
    "HashPrefixCache",
    "LFUPolicy",
    "LRUPolicy",
    "ModelSettings",
    "PinError",
    "PinnedPrefix",
    "PrefixCache",
    "PrefixMatch",
    "PrefixNode",
    "RadixPrefixCache",
    "Retention",
    "RetentionError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerSettings",
    "make_cache",
    "make_policy",
]
