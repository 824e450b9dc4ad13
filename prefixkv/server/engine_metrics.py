"""Owns: the engine-state series of ``GET /metrics``, read from a snapshot at scrape time.
Imports: prefixkv.engine's stats and prefixkv.tiers' stats; metrics.py registers the collector.

Running / waiting requests, preemptions, the pool's free / cached / pinned / locked blocks,
evictions and hit rates, the lower tiers' series (one per tier, label ``tier``) and vLLM's
``cache_config_info``. :func:`engine_gauges` takes the snapshot from the engine's stats.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixkv.engine.outputs import EngineStats
from prefixkv.server.cache_metrics import CacheView, cache_metrics
from prefixkv.tiers.stats import TierStats


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """Engine state at one instant (what the scrape-time series report)."""

    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks: int
    free_blocks: int
    cached_blocks: int
    pinned_blocks: int
    locked_blocks: int
    evictions: int
    evicted_blocks: int
    query_hit_rate: float
    token_hit_rate: float
    tiers: tuple[TierStats, ...] = ()
    num_preemptions: int = 0
    block_size: int = 0
    enable_prefix_caching: bool = True
    cache: CacheView | None = None
    """Per-tenant usage, windowed hit rates, residency (``cache_metrics.py``)."""


class EngineCollector(Collector):
    """Reports the latest :class:`EngineGauges` snapshot (nothing before the first one)."""

    def __init__(self, model_name: str) -> None:
        self.snapshot: EngineGauges | None = None
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        labels = ["model_name"]
        values = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"prefixkv:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"prefixkv:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_requests_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_requests_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use by running requests "
                    "or the prefix cache (1 = full).",
                    1.0 - s.free_blocks / s.num_kv_blocks if s.num_kv_blocks else 0.0)
        yield gauge("num_kv_blocks", "KV blocks in the pool.", s.num_kv_blocks)
        yield gauge("cache_free_blocks", "KV blocks in the free list.", s.free_blocks)
        yield gauge("cache_cached_blocks", "KV blocks held by the prefix index.", s.cached_blocks)
        yield gauge("cache_pinned_blocks", "Cached blocks pinned against eviction.", s.pinned_blocks)
        yield gauge("cache_locked_blocks", "Cached blocks in use by running requests.", s.locked_blocks)
        yield gauge("prefix_cache_query_hit_rate", "Index lookups with a non-empty match over "
                    "all lookups (seed 004's hit rate).", s.query_hit_rate)
        yield gauge("prefix_cache_token_hit_rate", "Matched tokens over looked-up tokens, as "
                    "counted by the index.", s.token_hit_rate)
        yield counter("prefix_cache_evictions", "Eviction calls that freed blocks.", s.evictions)
        yield counter("prefix_cache_evicted_blocks", "Blocks evicted from the prefix cache.",
                      s.evicted_blocks)
        yield counter("num_preemptions", "Running requests preempted (their KV freed, to be "
                      "recomputed) for room.", s.num_preemptions)
        yield from _tier_metrics(self._model, s.tiers)
        if s.cache is not None:
            yield from cache_metrics(self._model, s.cache)
        host = next((t.capacity_blocks for t in s.tiers if t.tier == "host"), 0)
        info = GaugeMetricFamily("prefixkv:cache_config_info", "The KV cache's configuration "
                                 "(vLLM's labels: the pool is its GPU blocks, the host tier its "
                                 "CPU blocks); the value is 1.", labels=[
                                     "model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                                     "enable_prefix_caching"])
        info.add_metric([self._model, str(s.block_size), str(s.num_kv_blocks), str(host),
                         str(s.enable_prefix_caching)], 1.0)
        yield info


_TIER_SERIES = (  # (name, kind, TierStats field, help); one series per tier (label "tier")
    ("kv_tier_hits", "counter", "hits", "Blocks requests took from this KV tier."),
    ("kv_tier_hit_tokens", "counter", "hit_tokens", "Prompt tokens served from this KV tier."),
    ("kv_tier_stored_bytes", "counter", "stored_bytes", "Bytes written into this KV tier."),
    ("kv_tier_loaded_bytes", "counter", "loaded_bytes", "Bytes loaded from this tier into the pool."),
    ("kv_tier_load_seconds", "counter", "load_seconds", "Seconds spent loading from this tier."),
    ("kv_tier_evictions", "counter", "evictions", "Blocks this tier dropped for room."),
    ("kv_tier_errors", "counter", "errors", "Failed calls to this tier (remote down, disk I/O)."),
    ("kv_tier_corrupt", "counter", "corrupt", "Stored blocks rejected by the checksum check."),
    ("kv_tier_unauthenticated", "counter", "unauthenticated",
     "Stored blocks rejected by the MAC check (kv_remote_secret set)."),
    ("kv_tier_prefetched", "counter", "prefetched", "Blocks read ahead for queued requests."),
    ("kv_tier_occupancy_blocks", "gauge", "occupancy_blocks", "Blocks this tier holds now."),
    ("kv_tier_capacity_blocks", "gauge", "capacity_blocks", "Blocks this tier can hold (0: unknown)."),
)


def _tier_metrics(model: str, tiers: tuple[TierStats, ...]) -> Iterator[Metric]:
    if not tiers:
        return
    for name, kind, field, doc in _TIER_SERIES:
        family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        m = family(f"prefixkv:{name}", doc, labels=["model_name", "tier"])
        for t in tiers:
            m.add_metric([model, t.tier], float(getattr(t, field)))
        yield m


def engine_gauges(s: EngineStats, cache: CacheView | None = None) -> EngineGauges:
    """The scrape-time metrics snapshot from the engine's stats (and ``cache_metrics``' view)."""
    c = s.cache
    return EngineGauges(
        num_requests_running=s.num_running,
        num_requests_waiting=s.num_waiting,
        num_kv_blocks=s.num_kv_blocks,
        free_blocks=s.num_free_blocks,
        cached_blocks=s.num_cached_blocks,
        pinned_blocks=c.pinned_blocks if c else 0,
        locked_blocks=c.locked_blocks if c else 0,
        evictions=c.evictions if c else 0,
        evicted_blocks=c.evicted_blocks if c else 0,
        query_hit_rate=c.query_hit_rate if c else 0.0,
        token_hit_rate=c.token_hit_rate if c else 0.0,
        tiers=tuple(s.tiers or ()),
        num_preemptions=s.num_preemptions,
        block_size=s.block_size,
        enable_prefix_caching=s.enable_prefix_caching,
        cache=cache,
    )
