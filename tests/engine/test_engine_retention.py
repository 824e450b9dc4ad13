"""Soft retention, tenant quotas and residency metrics through the engine (the demo model):
outputs unchanged, a retained prefix surviving floods of other prompts, two tenants under a
quota, hit rates per tenant and cache key, sampled block lifetimes per tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixkv.engine import LLM, Retention, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("config", [dict(index="radix", block_size=16, num_kv_blocks=10),
                                    dict(index="hash", block_size=4, num_kv_blocks=40,
                                         max_cached_blocks_per_tenant=12)])
def test_greedy_outputs_unchanged_with_retention(config: dict, demo_model: Path, make_llm: Any,
                                                 helpers: Any) -> None:
    prompts = helpers.shared_prefix_workload(8)
    ref = LLM(demo_model, enable_prefix_caching=False, num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    llm = make_llm(**config)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                             retention=Retention(priority=i * 10 % 101, ttl_s=60 + i))
              if i % 2 else GREEDY for i in range(len(prompts))]
    for _round in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want
    helpers.assert_no_leak(llm)
    llm.engine.kv.cache.check_invariants()


def flood(llm: LLM, helpers: Any, start: int, count: int, **kw: Any) -> None:
    for i in range(start, start + count):
        llm.generate({"prompt_token_ids": helpers.tokens(500 + i, 40)}, GREEDY, **kw)


def test_a_retained_prefix_survives_floods_of_other_prompts(make_llm: Any, helpers: Any) -> None:
    system = helpers.tokens(1, 64)  # 4 blocks
    results = {}
    for retained in (False, True):
        llm = make_llm(block_size=16, num_kv_blocks=12)
        if retained:
            assert llm.retain_prefix({"prompt_token_ids": system},
                                     Retention(priority=50, ttl_s=3600)) == 4
            assert llm.engine.kv.cache.get_stats().retained_blocks == 4
        else:
            llm.generate({"prompt_token_ids": system}, GREEDY)
        flood(llm, helpers, 0, 12)  # 12 prompts of 3 blocks through a 12-block pool
        out = llm.generate({"prompt_token_ids": system + helpers.tokens(2, 5)}, GREEDY)[0]
        results[retained] = out.num_cached_tokens
        helpers.assert_no_leak(llm)
    assert results == {False: 0, True: 64}


def test_retention_refused_past_the_tenant_quota(make_llm: Any, helpers: Any) -> None:
    from prefixkv.cache import RetentionError

    llm = make_llm(block_size=16, num_kv_blocks=40, max_cached_blocks_per_tenant=4)
    assert llm.retain_prefix({"prompt_token_ids": helpers.tokens(3, 50)}, Retention(),
                             cache_salt="a") == 3
    with pytest.raises(RetentionError, match="max_blocks_per_tenant=4"):
        llm.retain_prefix({"prompt_token_ids": helpers.tokens(4, 40)}, Retention(),
                          cache_salt="a")
    assert llm.engine.cache_admin.tenants()[("a", None)].retained_blocks == 3


def test_a_tenant_over_its_quota_cannot_flush_another(make_llm: Any, helpers: Any) -> None:
    quiet = helpers.tokens(9, 80)  # 5 blocks
    cached = {}
    for quota in (None, 8):
        llm = make_llm(block_size=16, num_kv_blocks=20, max_cached_blocks_per_tenant=quota)
        llm.generate({"prompt_token_ids": quiet}, GREEDY, cache_salt="b")
        flood(llm, helpers, 0, 12, cache_salt="a")
        usage = llm.engine.cache_admin.tenants()
        out = llm.generate({"prompt_token_ids": quiet + [65]}, GREEDY, cache_salt="b")[0]
        cached[quota] = out.num_cached_tokens
        if quota is not None:
            assert usage[("b", None)].cached_blocks == 5
            assert usage[("a", None)].cached_blocks <= 20 - 5
        helpers.assert_no_leak(llm)
    assert cached == {None: 0, 8: 80}


def test_hit_rates_per_tenant_and_cache_key(make_llm: Any, helpers: Any) -> None:
    llm = make_llm(block_size=16)
    system = helpers.tokens(5, 48)
    for turn in range(3):
        params = SamplingParams(temperature=0.0, max_tokens=2, cache_key="session-1")
        llm.generate({"prompt_token_ids": system + helpers.tokens(10 + turn, 4)}, params,
                     cache_salt="t1")
    llm.generate({"prompt_token_ids": helpers.tokens(6, 20)}, GREEDY)
    rates = llm.engine.cache_admin.hit_rates()
    s = rates.by_key["session-1"]
    assert (s.requests, s.hits, s.hit_tokens) == (3, 2, 2 * 48)
    assert rates.by_tenant[("t1", None)].requests == 3
    assert rates.by_tenant[None].hits == 0
    with pytest.raises(ValueError, match="cache_key"):
        SamplingParams(cache_key="x" * 2000)


def test_residency_metrics_per_tier(make_llm: Any, helpers: Any, tmp_path: Path) -> None:
    llm = make_llm(block_size=16, num_kv_blocks=12, kv_cache_metrics=True,
                   kv_cache_metrics_sample=1.0, kv_offload_size=8)
    system = helpers.tokens(7, 48)
    llm.generate({"prompt_token_ids": system + [66]}, GREEDY)
    llm.generate({"prompt_token_ids": system + [67]}, GREEDY)  # a reuse of 3 blocks
    flood(llm, helpers, 0, 10)  # evictions from the pool into the host tier, and out of it
    stats = {s.tier: s for s in llm.engine.cache_admin.residency()}
    assert set(stats) == {"pool", "host"}
    pool = stats["pool"]
    assert pool.reuse_gap.count >= 3 and pool.lifetime.count > 0
    assert pool.idle_before_evict.count == pool.lifetime.count
    assert stats["host"].lifetime.count > 0
    off = make_llm(block_size=16)
    assert off.engine.cache_admin.residency() == []
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        make_llm(kv_cache_metrics_sample=0)


def test_retention_travels_to_the_lower_tiers(make_llm: Any, helpers: Any,
                                              tmp_path: Path) -> None:
    llm = make_llm(block_size=16, num_kv_blocks=40, kv_offload_size=8, kv_disk_dir=tmp_path)
    system = helpers.tokens(8, 64)
    params = SamplingParams(temperature=0.0, max_tokens=2, retention=Retention(80, 600))
    llm.generate({"prompt_token_ids": system + [70]}, params)
    tiers = llm.engine.kv.tiers
    chain = tiers.keyer.extend([], system, 4, None)
    assert all(tiers.retained.priority(k) == 80 for k in chain)
    llm.engine.cache_admin.reset("all")
    assert len(tiers.retained) == 0


def test_async_engine_retain_prefix(demo_model: Path, helpers: Any) -> None:
    import asyncio

    from prefixkv.engine import AsyncEngine

    eng = AsyncEngine.from_args(demo_model, block_size=4, num_kv_blocks=64)
    try:
        prefix = helpers.tokens(31, 24)

        async def run() -> tuple[int, int, int]:
            n = await eng.retain_prefix(prefix, Retention(priority=70, ttl_s=600),
                                        cache_salt="s")
            last = None
            async for last in eng.generate(prefix + [40, 41], SamplingParams(max_tokens=2),
                                           cache_salt="s"):
                pass
            assert last is not None
            usage = await eng.call(lambda e: e.cache_admin.tenants())
            return n, last.num_cached_tokens, usage[("s", None)].retained_blocks

        n, cached_tokens, retained = asyncio.run(run())
        assert n == 6 and cached_tokens == 24 and retained >= 6
    finally:
        eng.shutdown()
