"""Owns: the per-tenant, per-``prompt_cache_key`` and block-residency series of ``GET /metrics``.
Imports: prefixkv.engine (cache_admin's records: tenants, hit rates, residency) and the tiers'
tenant labels only.

Read at scrape time on the engine thread (:func:`cache_view`), reported by ``engine_metrics.py``'s
collector:

* ``prefixkv:tenant_cached_blocks`` / ``prefixkv:tenant_retained_blocks`` (gauges, label
  ``tenant``): the pool's blocks per tenant (``cache_salt``, LoRA adapter);
* ``prefixkv:tenant_tier_blocks`` (gauge, labels ``tenant`` and ``tier``: ``host``, ``disk``,
  ``remote``): each lower tier's blocks per tenant (the remote's only with a quota);
* ``prefixkv:prefix_cache_hit_rate_by_tenant`` / ``..._by_cache_key`` (gauges: reused over
  queried prompt tokens, requests admitted in the last window), and
  ``prefixkv:prefix_cache_window_requests_by_tenant`` / ``..._by_cache_key``;
* vLLM's sampled residency histograms (``--kv-cache-metrics``), label ``tier`` (``pool``,
  ``host``, ``disk``): ``kv_block_lifetime_seconds``, ``kv_block_idle_before_evict_seconds``,
  ``kv_block_reuse_gap_seconds`` (also as ``vllm:<name>``).

Bounded cardinality: at most :data:`TOP_N` tenants and keys each (the most blocks, the most
requests), the rest summed under ``other``; a label value is never the salt or key itself
(tenant keys are secrets) but the first 12 hex digits of its SHA-256 (``default``: no tenant),
which an operator matches with ``/v1/cache/stats`` (admin) or by hashing a known salt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from prefixkv.cache.quotas import TenantUsage
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine.residency import HitRate, HitRates, ResidencyStats
from prefixkv.tiers.quotas import tenant_label

TOP_N = 10
"""Most tenants (and, apart, ``prompt_cache_key`` s) with a series of their own."""

RESIDENCY = (("kv_block_lifetime_seconds", "lifetime", "Sampled KV blocks' time from stored to evicted."),
             ("kv_block_idle_before_evict_seconds", "idle_before_evict",
              "Sampled KV blocks' time from last use to eviction."),
             ("kv_block_reuse_gap_seconds", "reuse_gap", "Time between consecutive uses of a sampled KV block."))
"""(series, ``ResidencyStats`` field, help): vLLM's names, one series per tier."""


@dataclass(frozen=True, slots=True)
class CacheView:
    """The cache's per-tenant usage, windowed hit rates and residency at one instant."""

    tenants: dict[Hashable | None, TenantUsage]
    hit_rates: HitRates
    residency: list[ResidencyStats]
    tier_tenants: dict[str, dict[str, int]]  # lower tier -> tenant label -> blocks


def cache_view(engine: LLMEngine) -> CacheView:
    """The snapshot (call it on the engine thread)."""
    admin = engine.cache_admin
    return CacheView(admin.tenants(), admin.hit_rates(), admin.residency(), admin.tier_tenants())


def label(name: Hashable | None) -> str:
    """A tenant's or key's label value: ``default`` for none, else a short SHA-256 of it (the
    lower tiers' tenant label, :func:`~prefixkv.tiers.quotas.tenant_label`)."""
    return tenant_label(name)


def _rates(kind: str, model: str, rates: dict[str, HitRate] | dict[Hashable | None, HitRate]
           ) -> Iterator[Metric]:
    hit = GaugeMetricFamily(f"prefixkv:prefix_cache_hit_rate_by_{kind}",
                            f"Reused over queried prompt tokens per {kind} over the last window.",
                            labels=["model_name", kind])
    reqs = GaugeMetricFamily(f"prefixkv:prefix_cache_window_requests_by_{kind}",
                             f"Requests admitted per {kind} over the last window.",
                             labels=["model_name", kind])
    ranked = sorted(rates.items(), key=lambda x: -x[1].requests)
    for name, r in ranked[:TOP_N]:
        hit.add_metric([model, label(name)], r.token_hit_rate)
        reqs.add_metric([model, label(name)], r.requests)
    rest = [r for _, r in ranked[TOP_N:]]
    if rest:
        queried = sum(r.queried_tokens for r in rest)
        hit.add_metric([model, "other"], sum(r.hit_tokens for r in rest) / queried if queried else 0.0)
        reqs.add_metric([model, "other"], sum(r.requests for r in rest))
    yield hit
    yield reqs


def cache_metrics(model: str, view: CacheView) -> Iterator[Metric]:
    """The series above for ``view``."""
    cached = GaugeMetricFamily("prefixkv:tenant_cached_blocks", "Pool blocks a tenant has cached "
                               "(top tenants; 'other': the rest).", labels=["model_name", "tenant"])
    kept = GaugeMetricFamily("prefixkv:tenant_retained_blocks", "Pool blocks a tenant has "
                             "soft-retained (top tenants).", labels=["model_name", "tenant"])
    ranked = sorted(view.tenants.items(), key=lambda x: -x[1].cached_blocks)
    for name, u in ranked[:TOP_N]:
        cached.add_metric([model, label(name)], u.cached_blocks)
        kept.add_metric([model, label(name)], u.retained_blocks)
    if len(ranked) > TOP_N:
        cached.add_metric([model, "other"], sum(u.cached_blocks for _, u in ranked[TOP_N:]))
        kept.add_metric([model, "other"], sum(u.retained_blocks for _, u in ranked[TOP_N:]))
    yield cached
    yield kept
    lower = GaugeMetricFamily("prefixkv:tenant_tier_blocks", "Blocks a tenant has in a lower "
                              "KV tier (top tenants per tier; 'other': the rest).",
                              labels=["model_name", "tenant", "tier"])
    for tier_name, counts in view.tier_tenants.items():
        top = sorted(counts.items(), key=lambda x: -x[1])
        for name, n in top[:TOP_N]:
            lower.add_metric([model, name, tier_name], n)
        if len(top) > TOP_N:
            lower.add_metric([model, "other", tier_name], sum(n for _, n in top[TOP_N:]))
    yield lower
    yield from _rates("tenant", model, view.hit_rates.by_tenant)
    yield from _rates("cache_key", model, view.hit_rates.by_key)
    if not view.residency:
        return
    for name, attr, doc in RESIDENCY:
        h = HistogramMetricFamily(f"prefixkv:{name}", doc, labels=["model_name", "tier"])
        for tier in view.residency:
            hist = getattr(tier, attr)
            bounds = [*map(str, hist.buckets), "+Inf"]
            running, buckets = 0, []
            for bound, n in zip(bounds, hist.counts):
                running += n
                buckets.append((bound, float(running)))
            h.add_metric([model, tier.tier], buckets, hist.total)
        yield h
