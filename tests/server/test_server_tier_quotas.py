"""Per-tenant quotas in the lower tiers over HTTP (issue 43, item 3): ``/v1/cache/stats``
(admin) gives each tenant its blocks per lower tier and its metrics label, and ``/metrics`` the
``prefixkv:tenant_tier_blocks`` gauge; a tenant flooding the host and disk tiers cannot flush
another's blocks there, and a restarted server counts the disk's tenants again (known by label
only until their requests come back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
from server_live import BLOCK_SIZE, MODEL, start_server, unique_text, wait_idle

from prefixkv.engine import AsyncEngine
from prefixkv.server.cache_metrics import label

POOL = 40
TIER = "24blocks"


def _engine(disk: Path) -> AsyncEngine:
    return AsyncEngine.from_args(None, block_size=BLOCK_SIZE, num_kv_blocks=POOL,
                                 max_cached_blocks_per_tenant=8, kv_offload_size=TIER,
                                 kv_disk_dir=str(disk), kv_disk_size=TIER)


def _row(stats: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in stats["tenants"] if t["label"] == name)


def test_stats_and_metrics_show_each_tenants_blocks_per_tier(tmp_path: Path) -> None:
    quiet_label, noisy_label = label(("tenant-q", None)), label(("tenant-f", None))
    quiet = unique_text("tierquiet", 12)
    eng = _engine(tmp_path)
    live = start_server(eng, model_name=MODEL)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        client.completions.create(model=MODEL, prompt=quiet, max_tokens=1,
                                  extra_body={"cache_salt": "tenant-q"})
        for i in range(16):  # ~4 blocks each: the pool, host and disk all overflow
            client.completions.create(model=MODEL, prompt=unique_text(f"tierflood{i}x", 12),
                                      max_tokens=1, extra_body={"cache_salt": "tenant-f"})
        with httpx.Client(base_url=live.url, timeout=60) as http:
            wait_idle(http)
            assert eng.engine.kv.tiers.flush()
            stats = http.get("/v1/cache/stats").json()
            text = http.get("/metrics").text
    finally:
        live.stop()
        eng.shutdown()
    q, f = _row(stats, quiet_label), _row(stats, noisy_label)
    assert q["cache_salt"] == "tenant-q" and f["cache_salt"] == "tenant-f"
    blocks = q["tier_blocks"]["disk"]
    assert blocks >= 3 and f["tier_blocks"]["disk"] == 24 - blocks  # the flood kept only its room
    assert f["tier_blocks"]["host"] > 8 and q["tier_blocks"].get("host", 0) <= 8
    assert (f'prefixkv:tenant_tier_blocks{{model_name="{MODEL}",tenant="{quiet_label}",'
            f'tier="disk"}} {float(blocks)}') in text
    assert "tenant-q" not in text

    again = _engine(tmp_path)  # a warm restart: the disk's tenants are counted again
    live = start_server(again, model_name=MODEL)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            stats = http.get("/v1/cache/stats").json()
    finally:
        live.stop()
        again.shutdown()
    q = _row(stats, quiet_label)
    assert q == {"cache_salt": None, "lora": None, "label": quiet_label, "cached_blocks": 0,
                 "retained_blocks": 0, "tier_blocks": {"disk": blocks}}
    assert _row(stats, noisy_label)["tier_blocks"] == {"disk": 24 - blocks}
