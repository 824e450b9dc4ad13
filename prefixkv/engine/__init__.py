"""prefixkv.engine: scheduler, sequences, sampling params, the ``LLM`` API and ``AsyncEngine``.

``LLM`` runs offline in the caller's thread; ``AsyncEngine`` runs the same :class:`LLMEngine`
on a background thread and streams :class:`RequestOutput` snapshots (the server uses it).
"""

from __future__ import annotations

from prefixkv.cache.retention import Retention
from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.engine.llm import LLM, build_engine
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestFailedError,
    RequestMetrics,
    RequestOutput,
)
from prefixkv.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineStats",
    "LLMEngine",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "Retention",
    "SamplingParams",
    "build_engine",
]
