"""TierMetrics: the connector's per-tier counters as Prometheus metrics on vLLM's ``/metrics``.

vLLM builds a connector's Prometheus metrics once in its front-end process
(``build_prom_metrics``) and hands each engine step's summed worker stats (the ``data`` of
:class:`~prefixkv.integrations.vllm.stats.PrefixKVStats`: one step's counts, not running
totals) to ``observe``. Series, each with vLLM's labels (``model_name``, ``engine``) plus
``tier`` (``host``, ``disk``, ``remote``: the tiers the connector runs):

=========================================== =========================================================
``vllm:prefixkv_loaded_blocks_total``       blocks loaded from the tier into vLLM's KV
``vllm:prefixkv_loaded_bytes_total``        their bytes
``vllm:prefixkv_load_failed_blocks_total``  blocks whose load failed (vLLM recomputes them)
``vllm:prefixkv_saved_blocks_total``        blocks copied into the host arena / queued for disk or
                                            Valkey
``vllm:prefixkv_load_seconds``              histogram: one observation per step and tier, the time
                                            that step's blocks of that tier took to load
=========================================== =========================================================

Pure Python: the metric classes come from vLLM (``metric_types``: prometheus_client's
``Counter`` / ``Histogram``, or vLLM's Ray wrappers), so the logic runs without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

TIERS = ("host", "disk", "remote")
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds; a host load of 15 blocks is ~7 ms, a Valkey one ~100-500 ms (docs/vllm.md)."""
COUNTERS = (  # (metric name, stats key with {tier}, help)
    ("vllm:prefixkv_loaded_blocks", "{tier}_blocks",
     "KV blocks PrefixKVConnector loaded from this tier into vLLM's KV cache."),
    ("vllm:prefixkv_loaded_bytes", "{tier}_bytes",
     "Bytes PrefixKVConnector loaded from this tier into vLLM's KV cache."),
    ("vllm:prefixkv_load_failed_blocks", "{tier}_failed_blocks",
     "KV blocks PrefixKVConnector could not load from this tier (vLLM recomputes them)."),
    ("vllm:prefixkv_saved_blocks", "saved_{tier}_blocks",
     "KV blocks PrefixKVConnector copied into the host tier or queued for the disk / Valkey tier."),
)
LOAD_SECONDS = ("vllm:prefixkv_load_seconds", "{tier}_load_times",
                "Seconds one engine step's loads from this tier took (one observation per step "
                "and tier).")


class TierMetrics:
    """The connector's Prometheus series per engine and tier; ``observe`` adds one step's
    stats to them."""

    def __init__(self, counter: Callable[..., Any], histogram: Callable[..., Any],
                 labelnames: list[str], per_engine_labelvalues: Mapping[int, list[object]],
                 tiers: Iterable[str] = TIERS) -> None:
        self.tiers = tuple(tiers)
        bad = sorted(set(self.tiers) - set(TIERS))
        if bad:
            raise ValueError(f"tiers: unknown {bad}; known: {list(TIERS)}")
        names = [*labelnames, "tier"]
        families = [(counter(name=name, documentation=doc, labelnames=names), key)
                    for name, key, doc in COUNTERS]
        name, key, doc = LOAD_SECONDS
        families.append((histogram(name=name, documentation=doc, labelnames=names,
                                   buckets=list(LOAD_BUCKETS)), key))
        # (engine, stats key) -> the labelled child; created up front so every series shows
        # (at 0) from the first scrape
        self._children: dict[tuple[int, str], Any] = {
            (engine, key.format(tier=tier)): family.labels(*values, tier)
            for engine, values in per_engine_labelvalues.items()
            for family, key in families for tier in self.tiers}

    def observe(self, data: Mapping[str, Any], engine_idx: int = 0) -> None:
        """Add one step's stats (``PrefixKVStats.data``, summed over workers); keys of tiers
        or engines not registered are ignored."""
        for (engine, key), child in self._children.items():
            if engine != engine_idx or key not in data:
                continue
            value = data[key]
            if isinstance(value, list):  # load times: one histogram observation each
                for seconds in value:
                    child.observe(seconds)
            elif value > 0:
                child.inc(value)
