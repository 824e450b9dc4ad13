"""Residency metrics with an injected clock: sampled lifetimes, idle times, reuse gaps, and
hit rates over a sliding window (pure Python)."""

from __future__ import annotations

import pytest

from prefixkv.engine.residency import (
    BUCKETS,
    MAX_KEYS,
    CacheObserver,
    Histogram,
    HitWindow,
    ResidencySampler,
)


def test_histogram_counts_and_prometheus_buckets() -> None:
    h = Histogram()
    for v in (0.05, 0.5, 7.0, 1e9):
        h.observe(v)
    assert h.count == 4 and h.total == pytest.approx(0.05 + 0.5 + 7.0 + 1e9)
    assert h.counts[0] == 1 and h.counts[1] == 1 and h.counts[BUCKETS.index(10.0)] == 1
    assert h.counts[-1] == 1  # above the last bound
    cum = h.cumulative()
    assert cum[0] == ("0.1", 1) and cum[1] == ("0.5", 2) and cum[-1] == ("+Inf", 4)
    assert cum[-2][1] == 3
    snap = h.copy()
    h.observe(1.0)
    assert snap.count == 4


def test_sampler_follows_blocks_from_store_to_eviction() -> None:
    now = [0.0]
    s = ResidencySampler("pool", 1.0, clock=lambda: now[0])
    s.stored([1, 2])
    now[0] = 3.0
    s.hit([1])
    now[0] = 10.0
    s.hit([1])
    now[0] = 12.0
    s.evicted([1, 2, 99])  # 99 was never sampled
    st = s.snapshot()
    assert st.tier == "pool" and st.sampled == 0
    assert st.lifetime.count == 2 and st.lifetime.total == pytest.approx(24.0)
    assert st.idle_before_evict.total == pytest.approx(2.0 + 12.0)
    assert st.reuse_gap.count == 2 and st.reuse_gap.total == pytest.approx(3.0 + 7.0)
    s.stored([5])
    s.forget([5])  # a reset is not an eviction
    assert s.snapshot().lifetime.count == 2


def test_sampling_rate_follows_about_that_share() -> None:
    s = ResidencySampler("host", 0.1)
    s.stored(range(10_000))
    assert 800 < s.snapshot().sampled < 1200
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        ResidencySampler("x", 0.0)


def test_hit_window_per_tenant_and_key_slides() -> None:
    now = [0.0]
    w = HitWindow(60.0, clock=lambda: now[0])
    w.record("a", "s1", 100, 0)
    now[0] = 30.0
    w.record("a", "s1", 100, 80)
    w.record(None, None, 50, 50)
    rates = w.snapshot()
    assert rates.by_key["s1"].requests == 2 and rates.by_key["s1"].token_hit_rate == 0.4
    assert rates.by_tenant["a"].hits == 1 and rates.by_tenant[None].token_hit_rate == 1.0
    now[0] = 61.0  # the first request left the window
    rates = w.snapshot()
    assert rates.by_key["s1"].requests == 1 and rates.by_key["s1"].token_hit_rate == 0.8
    now[0] = 200.0
    assert w.snapshot().by_tenant == {}


def test_hit_window_keeps_at_most_max_keys() -> None:
    w = HitWindow(60.0, clock=lambda: 0.0)
    for i in range(MAX_KEYS + 10):
        w.record(None, f"k{i}", 1, 1)
    rates = w.snapshot()
    assert len(rates.by_key) + len(rates.by_tenant) <= MAX_KEYS
    assert f"k{MAX_KEYS + 9}" in rates.by_key


def test_observer_without_metrics_keeps_hit_rates_only() -> None:
    off = CacheObserver()
    assert off.pool is None and off.tier("host") is None and off.residency() == []
    on = CacheObserver(1.0)
    assert on.tier("disk") is on.tier("disk")
    assert [s.tier for s in on.residency()] == ["pool", "disk"]
