"""PrefixKVStats: the connector's counters as vLLM's ``KVConnectorStats`` (worker -> logger),
and :class:`PrefixKVPromMetrics`, the same counters on vLLM's ``/metrics``.

Per tier (host, disk, remote): blocks, bytes and seconds loaded, the seconds of each step's
loads (``<tier>_load_times``, a list), blocks that failed to load, blocks saved to the host arena
and queued for disk / Valkey. vLLM sums them over workers and a logging interval
(``aggregate``) and logs ``reduce()``: the sums plus milliseconds per loaded block per tier.
Each engine step's stats also go to ``PrefixKVPromMetrics.observe`` (:mod:`.prom`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from prefixkv.integrations.vllm.config import ConnectorConfig
from prefixkv.integrations.vllm.prom import TIERS, TierMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT


@dataclass
class PrefixKVStats(KVConnectorStats):  # type: ignore[misc]
    """Summed counters (``data``: name -> number, or a list of load times)."""

    def reset(self) -> None:
        """Clear the counters."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counters to these (lists are joined)."""
        for name, value in other.data.items():
            if isinstance(value, list):
                self.data[name] = [*self.data.get(name, ()), *value]
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters (without the load-time lists), plus ``<tier>_ms_per_block`` where a
        tier loaded any."""
        out: dict[str, int | float] = {k: v for k, v in self.data.items()
                                       if not isinstance(v, list)}
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


class PrefixKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """vLLM's per-connector Prometheus metrics: the series of :class:`TierMetrics` for the
    tiers the connector runs (from ``kv_connector_extra_config``)."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        spec = ConnectorConfig.from_extra(
            vllm_config.kv_transfer_config.kv_connector_extra_config).spec
        tiers = [t for t, on in zip(TIERS, (bool(spec.offload_size), spec.disk_dir is not None,
                                            spec.remote is not None)) if on]
        self.tiers = TierMetrics(metric_types[Counter], metric_types[Histogram], labelnames,
                                 per_engine_labelvalues, tiers)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one engine step's stats to the series."""
        self.tiers.observe(transfer_stats_data, engine_idx)
