"""prefixkv's disk and Valkey tiers as SGLang's L3 (``HiCacheStorage``), see docs/sglang.md.

``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name": "prefixkv", "module_path": "prefixkv.integrations.sglang",
"class_name": "PrefixKVStorage", "interface_v1": 1, "kv_disk_dir": ...}'``.

:class:`PrefixKVStorage` imports SGLang and torch, so it is loaded on first access; the settings
and key mapping (:mod:`prefixkv.integrations.sglang.config`) need neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixkv.integrations.sglang.config import PageKeys, Shard, StorageSettings

if TYPE_CHECKING:
    from prefixkv.integrations.sglang.backend import PrefixKVStorage

__all__ = ["PageKeys", "PrefixKVStorage", "Shard", "StorageSettings"]


def __getattr__(name: str) -> Any:
    if name == "PrefixKVStorage":  # what SGLang's factory asks the module for
        from prefixkv.integrations.sglang.backend import PrefixKVStorage

        return PrefixKVStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
