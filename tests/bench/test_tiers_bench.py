from __future__ import annotations

from prefixkv.bench.tiers import run_tiers_bench


def test_tiers_bench_runs_every_local_mode() -> None:
    res = run_tiers_bench(prefix_tokens=64, rounds=1)
    assert set(res["median_ttft_s"]) == {"recompute", "pool", "host", "disk"}
    assert res["ratio_to_pool"]["pool"] == 1.0
    tiers = {t.tier: t for t in res["tiers"]}
    assert tiers["host"].hits > 0 and tiers["disk"].hits > 0
