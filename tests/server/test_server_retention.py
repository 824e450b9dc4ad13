"""Retention a client asks for, over HTTP (issue 43): Anthropic's ``cache_control`` (usage
checked against what the cache did), OpenAI's ``prompt_cache_retention``, the ``priority``
field bounded by ``--max-retention-priority``, the admin pin's ``ttl_s`` / ``priority``, and
per-tenant quotas and hit rates in ``/v1/cache/stats`` and ``/metrics``.

The pressure tests run their own small-pool engines, so a flood of prompts evicts for real.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from server_live import BLOCK_SIZE, MODEL, LiveServer, start_server, unique_text, wait_idle

from prefixkv.cli import main
from prefixkv.engine import AsyncEngine
from prefixkv.server.limits import ServerLimits

SMALL_POOL = 40  # blocks: a few prompts fill it


def _client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


def _system_len(engine: AsyncEngine, system: str) -> int:
    """Tokens of the system turn alone (where a breakpoint on it falls with the demo template)."""
    rendered = engine.engine.chat_prompt([{"role": "system", "content": system}], False)
    return len(rendered["prompt_token_ids"])


def _tenant(stats: dict[str, Any], salt: str) -> dict[str, Any]:
    return next((t for t in stats["tenants"] if t["cache_salt"] == salt),
                {"cached_blocks": 0, "retained_blocks": 0})


def _cached(http: httpx.Client, text: str, salt: str | None = None) -> int:
    body: dict[str, Any] = {"text": text} if salt is None else {"text": text, "cache_salt": salt}
    r = http.post("/v1/cache/lookup", json=body)
    assert r.status_code == 200, r.text
    return int(r.json()["cached_tokens"])


# ------------------------------------------------------------------ Anthropic cache_control


def test_cache_control_usage_matches_the_cache(server: LiveServer, http: httpx.Client) -> None:
    salt = f"cc-{uuid.uuid4().hex}"
    system = unique_text("ccsys", 60)
    bp = _system_len(server.engine, system)
    created = bp // BLOCK_SIZE * BLOCK_SIZE
    client = _client(server.url)

    def ask(question: str) -> Any:
        return client.messages.create(
            model=MODEL, max_tokens=2, extra_body={"cache_salt": salt},
            system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": question}])

    first = ask(unique_text("ccq1", 5)).usage
    assert first.cache_read_input_tokens == 0
    assert first.cache_creation_input_tokens == created > 0
    assert first.cache_creation.ephemeral_5m_input_tokens == created
    assert first.cache_creation.ephemeral_1h_input_tokens == 0
    stats = wait_idle(http)
    assert _tenant(stats, salt)["retained_blocks"] == created // BLOCK_SIZE  # what the cache did

    second = ask(unique_text("ccq2", 5)).usage
    assert second.cache_creation_input_tokens == 0
    assert second.cache_read_input_tokens >= created  # the system prefix (and what follows it)
    count = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": unique_text("ccq2", 5)}], system=system)
    assert (second.input_tokens + second.cache_read_input_tokens
            + second.cache_creation_input_tokens) == count.input_tokens


def test_cache_control_on_a_content_block_with_1h_streams_its_usage(server: LiveServer) -> None:
    salt = f"cc-{uuid.uuid4().hex}"
    doc = unique_text("ccdoc", 50)
    client = _client(server.url)
    blocks = [{"type": "text", "text": doc, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
              {"type": "text", "text": " what next?"}]
    with client.messages.stream(model=MODEL, max_tokens=2, extra_body={"cache_salt": salt},
                                messages=[{"role": "user", "content": blocks}]) as stream:
        final = stream.get_final_message()
    u = final.usage
    assert u.cache_creation_input_tokens > 0 and u.cache_read_input_tokens == 0
    assert u.cache_creation.ephemeral_1h_input_tokens == u.cache_creation_input_tokens
    assert u.cache_creation_input_tokens % BLOCK_SIZE == 0


def test_two_breakpoints_split_creation_by_ttl_and_the_request_mark(server: LiveServer) -> None:
    """A 1h mark on the system prompt and a 5m one on the question: the system's blocks are
    created under 1h, the question's further blocks under 5m; the request-level mark (automatic
    caching) covers the whole conversation before the answer."""
    salt = f"cc2-{uuid.uuid4().hex}"
    system, question = unique_text("cc2sys", 30), unique_text("cc2q", 30)
    eng = server.engine.engine
    sys_end = _system_len(server.engine, system) // BLOCK_SIZE * BLOCK_SIZE
    turns = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    conv_end = len(eng.chat_prompt(turns, False)["prompt_token_ids"]) // BLOCK_SIZE * BLOCK_SIZE
    client = _client(server.url)
    u = client.messages.create(
        model=MODEL, max_tokens=1, extra_body={"cache_salt": salt},
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]}]).usage
    assert u.cache_creation.ephemeral_1h_input_tokens == sys_end
    assert u.cache_creation.ephemeral_5m_input_tokens == conv_end - sys_end > 0
    auto = client.messages.create(
        model=MODEL, max_tokens=1, extra_body={"cache_salt": salt + "-auto",
                                               "cache_control": {"type": "ephemeral"}},
        system=system, messages=[{"role": "user", "content": question}]).usage
    assert auto.cache_creation_input_tokens == conv_end and auto.cache_read_input_tokens == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"cache_control": {"type": "persistent"}}, "cache_control"),
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control"),
])
def test_cache_control_bad_values_are_400(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert param in r.text


def test_cache_control_limits_are_anthropics(http: httpx.Client) -> None:
    mark = {"type": "ephemeral"}
    five = [{"type": "text", "text": f"part {i}", "cache_control": mark} for i in range(5)]
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        r = http.post(route, json={"model": MODEL, "max_tokens": 1,
                                   "messages": [{"role": "user", "content": five}]})
        assert r.status_code == 400 and "at most 4" in r.text, r.text
    ok = http.post("/v1/messages/count_tokens", json={"model": MODEL, "cache_control": mark,
                                                       "messages": [{"role": "user", "content": five[:3]}]})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0, ok.text
    late_1h = [{"type": "text", "text": "a", "cache_control": mark},
               {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                        "messages": [{"role": "user", "content": late_1h}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1].cache_control"


# ------------------------------------------------------------------ pressure: a small pool


@pytest.fixture(scope="module")
def small() -> Iterator[LiveServer]:
    eng = AsyncEngine.from_args(None, block_size=BLOCK_SIZE, num_kv_blocks=SMALL_POOL)
    live = start_server(eng, model_name=MODEL, limits=ServerLimits(max_retention_priority=10))
    yield live
    live.stop()
    eng.shutdown()


def _flood(client: openai.OpenAI, tag: str, n: int, **extra: Any) -> None:
    for i in range(n):  # ~6 blocks each: together about twice the pool
        client.completions.create(model=MODEL, prompt=unique_text(f"{tag}{i}x", 12), max_tokens=1,
                                  extra_body=extra or None)


def test_prompt_cache_retention_survives_a_flood(small: LiveServer) -> None:
    client = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0)
    kept, plain = unique_text("keep24h", 12), unique_text("plain", 14)
    out = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": kept}], prompt_cache_retention="24h")
    client.completions.create(model=MODEL, prompt=kept, max_tokens=1,
                              extra_body={"prompt_cache_retention": "24h"})
    client.completions.create(model=MODEL, prompt=plain, max_tokens=1)
    assert out.choices[0].finish_reason is not None
    with httpx.Client(base_url=small.url, timeout=60) as http:
        assert _cached(http, kept) >= 4 * BLOCK_SIZE and _cached(http, plain) >= 4 * BLOCK_SIZE
        _flood(client, "flood24", 12)
        assert _cached(http, plain) == 0  # the policy evicted the unretained prompt
        assert _cached(http, kept) >= 4 * BLOCK_SIZE  # the retained one outlived the flood
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                               "prompt_cache_retention": "forever"})
        assert r.status_code == 400 and "prompt_cache_retention" in r.text


def test_priority_is_bounded_by_the_operator(small: LiveServer) -> None:
    """A request's priority 99 is capped at --max-retention-priority (10 here): under a flood
    that retains at 10 too, it goes before an admin retention at 20 (uncapped: it would stay)."""
    client = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0)
    asked, admin = unique_text("prio99", 12), unique_text("admin20", 12)
    with httpx.Client(base_url=small.url, timeout=60) as http:
        client.completions.create(model=MODEL, prompt=asked, max_tokens=1, extra_body={"priority": 99})
        r = http.post("/v1/cache/pin", json={"text": admin, "priority": 20, "ttl_s": 600})
        assert r.status_code == 200 and r.json()["retained"] and not r.json()["pinned"], r.text
        assert r.json()["num_blocks"] == len(small.engine.engine.tokenize(admin)[1]) // BLOCK_SIZE
        _flood(client, "floodprio", 12, priority=10)
        assert _cached(http, admin) >= 4 * BLOCK_SIZE
        assert _cached(http, asked) == 0
        assert http.get("/v1/cache/pinned").json()["data"] == []  # a retention is not a pin
        bad = http.post("/v1/cache/pin", json={"text": admin, "priority": 101})
        assert bad.status_code == 400 and "priority" in bad.text


def test_quotas_per_tenant_in_stats_and_metrics() -> None:
    eng = AsyncEngine.from_args(None, block_size=BLOCK_SIZE, num_kv_blocks=SMALL_POOL,
                                max_cached_blocks_per_tenant=12)
    live = start_server(eng, model_name=MODEL)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        quiet = unique_text("quietA", 12)
        client.completions.create(model=MODEL, prompt=quiet, max_tokens=1,
                                  extra_body={"cache_salt": "tenant-a", "prompt_cache_key": "sess-a"})
        first = [client.completions.create(model=MODEL, prompt=quiet, max_tokens=1,
                                           extra_body={"cache_salt": "tenant-a"})]
        _flood(client, "noisyB", 8, cache_salt="tenant-b")
        with httpx.Client(base_url=live.url, timeout=60) as http:
            stats = wait_idle(http)
            a, b = _tenant(stats, "tenant-a"), _tenant(stats, "tenant-b")
            assert a["cached_blocks"] >= 4 and b["cached_blocks"] > 12  # B over its quota...
            assert _cached(http, quiet, "tenant-a") >= 4 * BLOCK_SIZE  # ...yet could not flush A
            rates = {t["cache_salt"]: t for t in stats["hit_rates"]["tenants"]}
            assert rates["tenant-a"]["requests"] == 2 and rates["tenant-a"]["hits"] == 1
            assert [k["prompt_cache_key"] for k in stats["hit_rates"]["prompt_cache_keys"]] == ["sess-a"]
            text = http.get("/metrics").text
        assert first[0].usage.prompt_tokens_details.cached_tokens > 0
        assert "prefixkv:tenant_cached_blocks{" in text and "tenant-a" not in text  # hashed ids
        assert 'prefixkv:prefix_cache_hit_rate_by_tenant' in text
    finally:
        live.stop()
        eng.shutdown()


# ------------------------------------------------------------------ the CLI, other dialects


def test_cli_pin_with_ttl_and_priority_retains_not_pins(server: LiveServer, http: httpx.Client,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    salt = f"cli-{uuid.uuid4().hex}"
    text = unique_text("clikeep", 20)
    code = main(["cache", "pin", "--url", server.url, "--text", text, "--cache-salt", salt,
                 "--ttl", "60", "--priority", "30"])
    out = capsys.readouterr().out
    blocks = len(server.engine.engine.tokenize(text)[1]) // BLOCK_SIZE
    assert code == 0 and f"retained {blocks} blocks at priority 30 for 60 s" in out, out
    assert _tenant(wait_idle(http), salt)["retained_blocks"] == blocks
    assert all(p["cache_salt"] != salt for p in http.get("/v1/cache/pinned").json()["data"])
    assert main(["cache", "pin", "--url", server.url, "--text", text, "--ttl", "-1"]) == 1


def test_responses_and_generate_carry_the_retention_fields(server: LiveServer, http: httpx.Client,
                                                           client: openai.OpenAI) -> None:
    """``prompt_cache_retention`` / ``priority`` on the Responses API and SGLang's ``/generate``
    retain the prompt (in the request's tenant), the answer unchanged."""
    salt = f"rsp-{uuid.uuid4().hex}"
    text = unique_text("rspkeep", 20)
    plain = client.responses.create(model=MODEL, input=text, max_output_tokens=3, temperature=0,
                                    store=False, extra_body={"cache_salt": salt + "-plain"})
    kept = client.responses.create(model=MODEL, input=text, max_output_tokens=3, temperature=0,
                                   store=False, prompt_cache_retention="24h", prompt_cache_key="k1",
                                   extra_body={"cache_salt": salt})
    assert kept.output_text == plain.output_text  # outputs unchanged
    assert _tenant(wait_idle(http), salt)["retained_blocks"] > 0
    assert _tenant(wait_idle(http), salt + "-plain")["retained_blocks"] == 0
    gen = http.post("/generate", json={"text": unique_text("genkeep", 20), "priority": 5,
                                       "cache_salt": salt + "-gen",
                                       "sampling_params": {"max_new_tokens": 1}})
    assert gen.status_code == 200, gen.text
    assert _tenant(wait_idle(http), salt + "-gen")["retained_blocks"] > 0
    bad = http.post("/generate", json={"text": "x", "priority": "high"})
    assert bad.status_code == 400 and "priority" in bad.text
    long_key = http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
        "prompt_cache_key": "k" * 1025})
    assert long_key.status_code == 400 and "prompt_cache_key" in long_key.text


def test_residency_histograms_in_metrics() -> None:
    eng = AsyncEngine.from_args(None, block_size=BLOCK_SIZE, num_kv_blocks=SMALL_POOL,
                                kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    live = start_server(eng, model_name=MODEL)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        _flood(client, "resid", 10)  # evicts: blocks live and die
        text = httpx.get(live.url + "/metrics", timeout=30).text
        for name in ("kv_block_lifetime_seconds", "kv_block_idle_before_evict_seconds",
                     "kv_block_reuse_gap_seconds"):
            assert f'vllm:{name}_bucket{{le="+Inf",model_name="{MODEL}",tier="pool"}}' in text
        count = next(line for line in text.splitlines()
                     if line.startswith("prefixkv:kv_block_lifetime_seconds_count"))
        assert float(count.rsplit(" ", 1)[1]) > 0
    finally:
        live.stop()
        eng.shutdown()
