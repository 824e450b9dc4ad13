"""Cache-aware routing over several OpenAI-compatible workers (``prefixkv route``).

Layers: ``app`` (HTTP front) -> ``proxy`` (the router core) -> ``policies`` / ``cache_aware``
(which owns per-worker approximate prefix trees, ``tree``, over :mod:`prefixkv.cache`, keyed by
``keys``); ``workers`` (registry, circuit breakers), ``health`` (probes), ``local`` (local worker
processes); ``config``, ``errors``, ``metrics``.
The router imports nothing above :mod:`prefixkv.cache`. Everything but the policies loads on first use
(``prefixkv --help`` stays fast and needs neither the web stack nor the cache core).
"""

from __future__ import annotations

import importlib
from typing import Any

from prefixkv.router.policies import (
    POLICY_NAMES,
    Decision,
    LeastLoadPolicy,
    Policy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
)

_LAZY = {
    "CacheAwarePolicy": "prefixkv.router.cache_aware",
    "ApproxTree": "prefixkv.router.tree",
    "RouteKey": "prefixkv.router.keys",
    "chat_key": "prefixkv.router.keys",
    "completion_key": "prefixkv.router.keys",
    "RouterConfig": "prefixkv.router.config",
    "Router": "prefixkv.router.proxy",
    "RouterServer": "prefixkv.router.app",
    "create_app": "prefixkv.router.app",
    "LocalWorkers": "prefixkv.router.local",
    "WorkerRegistry": "prefixkv.router.workers",
}

__all__ = [
    "POLICY_NAMES",
    "ApproxTree",
    "CacheAwarePolicy",
    "Decision",
    "LeastLoadPolicy",
    "LocalWorkers",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteKey",
    "Router",
    "RouterConfig",
    "RouterServer",
    "WorkerRegistry",
    "chat_key",
    "completion_key",
    "create_app",
    "make_policy",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prefixkv.router' has no attribute {name!r}")
