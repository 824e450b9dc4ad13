"""Cache-aware routing over several OpenAI-compatible workers (``prefixkv route``).

Layers: ``app`` (HTTP front) -> ``proxy`` (the router core) -> ``policies`` -> ``tree``
(per-worker approximate prefix trees over :mod:`prefixkv.cache`); ``workers`` (registry, health,
local processes); ``metrics``.
The router imports nothing above :mod:`prefixkv.cache`. Everything but the policies loads on first use
(``prefixkv --help`` stays fast and needs neither the web stack nor the cache core).
"""

from __future__ import annotations

import importlib
from typing import Any

from prefixkv.router.policies import (
    POLICY_NAMES,
    CacheAwarePolicy,
    Decision,
    LeastLoadPolicy,
    Policy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
)

_LAZY = {
    "ApproxTree": "prefixkv.router.tree",
    "PrefixTrees": "prefixkv.router.tree",
    "RouteKey": "prefixkv.router.tree",
    "chat_key": "prefixkv.router.tree",
    "completion_key": "prefixkv.router.tree",
    "RouterConfig": "prefixkv.router.proxy",
    "Router": "prefixkv.router.proxy",
    "RouterServer": "prefixkv.router.app",
    "create_app": "prefixkv.router.app",
    "LocalWorkers": "prefixkv.router.workers",
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
    "PrefixTrees",
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
