"""``GET /metrics``: vLLM-style series with the ``prefixkv:`` prefix, rising with traffic."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from server_live import MODEL, unique_text


def _scrape(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"[{sample.labels['finished_reason']}]"
            if "le" in sample.labels or "status" in sample.labels:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


EXPECTED = [
    "prefixkv:prefix_cache_queries_total", "prefixkv:prefix_cache_hits_total",
    "prefixkv:prefix_cache_hit_rate", "prefixkv:prompt_tokens_total",
    "prefixkv:generation_tokens_total", "prefixkv:num_requests_running",
    "prefixkv:num_requests_waiting", "prefixkv:cache_cached_blocks",
    "prefixkv:cache_pinned_blocks", "prefixkv:cache_free_blocks",
    "prefixkv:prefix_cache_evicted_blocks_total", "prefixkv:prefix_cache_evictions_total",
    "prefixkv:time_to_first_token_seconds_count", "prefixkv:e2e_request_latency_seconds_count",
    "prefixkv:kv_cache_usage_perc",
]


def test_metrics_counters_rise(http: httpx.Client, client: openai.OpenAI) -> None:
    before = _scrape(http)
    for name in EXPECTED:
        assert name in before, name
    prompt = unique_text("metrics", 50)
    r1 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    r2 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    after = _scrape(http)
    n = r1.usage.prompt_tokens

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("prefixkv:prefix_cache_queries_total") == 2 * n
    assert delta("prefixkv:prefix_cache_hits_total") == r2.usage.prompt_tokens_details.cached_tokens > 0
    assert delta("prefixkv:prompt_tokens_total") == 2 * n
    assert delta("prefixkv:generation_tokens_total") == 6
    assert delta("prefixkv:request_success_total[length]") == 2
    assert delta("prefixkv:time_to_first_token_seconds_count") == 2
    assert delta("prefixkv:e2e_request_latency_seconds_count") == 2
    assert 0 < after["prefixkv:prefix_cache_hit_rate"] <= 1
    assert after["prefixkv:cache_cached_blocks"] >= n // 16


def test_errors_are_counted(http: httpx.Client) -> None:
    def errors_400() -> float:
        text = http.get("/metrics").text
        lines = [ln for ln in text.splitlines()
                 if ln.startswith("prefixkv:request_errors_total") and 'status="400"' in ln]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    before = errors_400()
    http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert errors_400() == before + 1


def test_vllm_metric_names_for_existing_dashboards(http: httpx.Client, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="metrics under vLLM names", max_tokens=2)
    text = http.get("/metrics").text
    values = {line.split("{")[0]: line for line in text.splitlines() if line.startswith("vllm:")}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert name in values, name
    ours = {line.split("{")[0].replace("prefixkv:", "vllm:"): line.rsplit(" ", 1)[1]
            for line in text.splitlines() if line.startswith("prefixkv:prefix_cache_queries_total")}
    assert values["vllm:prefix_cache_queries_total"].rsplit(" ", 1)[1] == ours["vllm:prefix_cache_queries_total"]
    stats = http.get("/v1/cache/stats").json()  # the cache's configuration, vLLM's info series
    info = values["vllm:cache_config_info"]
    assert f'num_gpu_blocks="{stats["num_kv_blocks"]}"' in info and f'block_size="{stats["block_size"]}"' in info
    assert 'enable_prefix_caching="True"' in info and 'num_cpu_blocks="0"' in info and info.endswith(" 1.0")


PHASES = ["request_queue_time_seconds", "request_prefill_time_seconds",
          "request_decode_time_seconds", "request_inference_time_seconds",
          "request_time_per_output_token_seconds"]


def test_vllm_phase_histograms_and_preemptions(http: httpx.Client, client: openai.OpenAI) -> None:
    """The series vLLM's Grafana dashboard reads beyond TTFT and latency: per-phase times,
    time per output token, prompt / generation lengths, preemptions; under both prefixes."""
    before = _scrape(http)
    for prefix in ("prefixkv:", "vllm:"):
        for name in [*(f"{p}_count" for p in PHASES), "request_prompt_tokens_sum",
                     "request_generation_tokens_sum", "num_preemptions_total"]:
            assert prefix + name in before, prefix + name
    prompt = unique_text("phases", 40)
    rs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True}) for _ in range(2)]
    after = _scrape(http)

    def delta(name: str) -> float:
        return after[name] - before[name]

    for p in PHASES:
        assert delta(f"prefixkv:{p}_count") == 2, p
        assert delta(f"vllm:{p}_count") == 2, p
    assert delta("prefixkv:request_prompt_tokens_sum") == sum(r.usage.prompt_tokens for r in rs)
    assert delta("prefixkv:request_generation_tokens_sum") == 12
    decode = delta("prefixkv:request_decode_time_seconds_sum")
    inference = delta("prefixkv:request_inference_time_seconds_sum")
    prefill = delta("prefixkv:request_prefill_time_seconds_sum")
    assert 0 < decode < inference and abs(inference - prefill - decode) < 1e-6
    assert abs(delta("prefixkv:request_time_per_output_token_seconds_sum") - decode / 5) < 1e-6
    assert delta("prefixkv:e2e_request_latency_seconds_sum") >= inference
    assert delta("prefixkv:num_preemptions_total") == 0


def test_preemptions_are_reported_from_the_engine_stats() -> None:
    from prefixkv.server.engine_metrics import EngineGauges
    from prefixkv.server.metrics import ServerMetrics

    g = EngineGauges(num_requests_running=1, num_requests_waiting=2, num_kv_blocks=8,
                     free_blocks=0, cached_blocks=0, pinned_blocks=0, locked_blocks=0,
                     evictions=0, evicted_blocks=0, query_hit_rate=0.0, token_hit_rate=0.0,
                     num_preemptions=3)
    text = ServerMetrics("m").render(g).decode()
    assert 'prefixkv:num_preemptions_total{model_name="m"} 3.0' in text
    assert 'vllm:num_preemptions_total{model_name="m"} 3.0' in text
