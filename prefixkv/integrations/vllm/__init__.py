"""prefixkv's KV tiers under vLLM: ``PrefixKVConnector`` (docs/vllm.md).

Load it with ``--kv-transfer-config '{"kv_connector": "PrefixKVConnector",
"kv_connector_module_path": "prefixkv.integrations.vllm", "kv_role": "kv_both", ...}'``.
The class is imported on first access, so the pure modules here (config, identity, plan,
scheduler_side) import without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PrefixKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "PrefixKVConnector":
        from prefixkv.integrations.vllm.connector import PrefixKVConnector

        return PrefixKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
