"""PrefixKVStats: the connector's counters as vLLM's ``KVConnectorStats`` (worker -> logger).

Per tier (host, disk, remote): blocks, bytes and seconds loaded; blocks that failed to load;
blocks saved to the host arena and queued for disk / Valkey. vLLM sums them over workers and a
logging interval (``aggregate``) and logs ``reduce()``: the sums plus milliseconds per loaded
block per tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

TIERS = ("host", "disk", "remote")


@dataclass
class PrefixKVStats(KVConnectorStats):  # type: ignore[misc]
    """Summed counters (``data``: name -> number)."""

    def reset(self) -> None:
        """Clear the counters."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counters to these."""
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, plus ``<tier>_ms_per_block`` where a tier loaded any."""
        out: dict[str, int | float] = dict(self.data)
        for tier in TIERS:
            blocks = self.data.get(f"{tier}_blocks", 0)
            if blocks:
                out[f"{tier}_ms_per_block"] = 1000 * self.data.get(f"{tier}_seconds", 0) / blocks
        return out

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.values())


def stats_from(data: dict[str, Any] | None) -> PrefixKVStats:
    """vLLM's ``build_kv_connector_stats`` hook."""
    return PrefixKVStats(data=dict(data or {}))
