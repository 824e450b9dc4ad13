"""The server with a host tier: cached tokens from a lower tier reach
``usage.prompt_tokens_details.cached_tokens`` and ``/v1/cache/stats`` shows per-tier counters;
the ``serve`` flags reach the engine."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys

import httpx
from server_live import start_server

from prefixkv.engine import AsyncEngine
from prefixkv.cli.serve import register
from prefixkv.cli.flags import engine_kwargs


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))


def sample_values(metrics: str) -> dict[str, float]:
    """``name`` (or ``name|source``) -> value of each sample line of one model's metrics."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{")[0]
        if 'source="' in name_labels:
            name += "|" + name_labels.split('source="')[1].split('"')[0]
        out[name] = float(value)
    return out


def test_host_tier_hits_are_cached_tokens_and_visible() -> None:
    engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=48, kv_offload_size="4MiB")
    live = start_server(engine, model_name="prefixkv-demo")
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            def complete(prompt: str) -> dict:  # type: ignore[type-arg]
                r = http.post("/v1/completions", json={
                    "model": "prefixkv-demo", "prompt": prompt, "max_tokens": 2,
                    "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()  # type: ignore[no-any-return]

            a, b = text(1, 600), text(2, 600)
            first = complete(a)
            complete(b)  # 48 blocks hold one of them: a's blocks go to host memory
            where = http.post("/v1/cache/lookup", json={"text": a}).json()  # read-only
            assert where["tiers"]["host"] >= 256 and where["tiers"]["pool"] > 0  # the head stayed
            assert where["prompt_tokens"] == 600 and where["cached_tokens"] >= 512
            assert where["cached_tokens"] == where["tiers"]["pool"] + where["tiers"]["host"]
            assert http.post("/v1/cache/lookup", json={"text": a}).json() == where  # nothing moved
            again = complete(a)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == where["cached_tokens"]
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 512
            stats = http.get("/v1/cache/stats").json()
            tiers = {t["tier"]: t for t in stats["tiers"]}
            assert set(tiers) == {"pool", "host"}
            assert tiers["host"]["hits"] > 0 and tiers["host"]["stored_blocks"] > 0
            assert tiers["host"]["capacity_blocks"] == (4 << 20) // 65536
            cli = subprocess.run(
                [sys.executable, "-m", "prefixkv.cli", "cache", "stats", "--url", live.url],
                capture_output=True, text=True, check=True, timeout=60)
            assert "Tier host: " in cli.stdout and "Tier pool: " in cli.stdout
            metrics = http.get("/metrics").text
            assert 'prefixkv:kv_tier_hits_total{model_name="prefixkv-demo",tier="host"}' in metrics
            assert 'prefixkv:kv_tier_occupancy_blocks{model_name="prefixkv-demo",tier="pool"}' in metrics
            # vLLM's split: the pool's hits in prefix_cache_hits, the lower tiers' apart
            v = sample_values(metrics)
            host_tokens = tiers["host"]["hit_tokens"]
            assert v["vllm:external_prefix_cache_hits_total"] == host_tokens > 0
            assert v["vllm:external_prefix_cache_queries_total"] >= host_tokens
            assert v["vllm:prompt_tokens_cached_total"] == v["prefixkv:prefix_cache_hits_total"]
            assert v["vllm:prefix_cache_hits_total"] == v["vllm:prompt_tokens_cached_total"] - host_tokens
            by = {src: v[f'vllm:prompt_tokens_by_source_total|{src}'] for src in
                  ("local_compute", "local_cache_hit", "external_kv_transfer")}
            assert by["external_kv_transfer"] == host_tokens
            assert sum(by.values()) == v["vllm:prompt_tokens_total"] == v["vllm:prefix_cache_queries_total"]
            assert v["vllm:request_prefill_kv_computed_tokens_sum"] == by["local_compute"]
    finally:
        live.stop()
        engine.shutdown()


def test_serve_flags_reach_the_engine_kwargs() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--kv-offload-size", "2GiB", "--kv-disk-dir", "/tmp/kv",
                              "--kv-disk-size", "4096", "--kv-remote", "redis://127.0.0.1:6379/0",
                              "--kv-remote-timeout", "0.25"])
    kw = engine_kwargs(args)
    assert kw["kv_offload_size"] == "2GiB" and kw["kv_disk_dir"] == "/tmp/kv"
    assert kw["kv_disk_size"] == "4096" and kw["kv_remote"] == "redis://127.0.0.1:6379/0"
    assert kw["kv_remote_timeout"] == 0.25
