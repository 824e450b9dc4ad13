"""Tenancy, concurrency and client disconnects against a live server."""

from __future__ import annotations

import asyncio

import httpx
import openai
from server_live import MODEL, LiveServer, unique_text, wait_idle


def _post_and_leave(url: str, body: dict[str, object]) -> None:
    """Post ``body`` and hang up after a second (a long generation is still running)."""
    try:
        httpx.post(url, json=body, timeout=1.0)
    except httpx.ReadTimeout:
        return  # the client gave up and closed the connection
    raise AssertionError("3,000 tokens should take longer than 1 s")


def _assert_aborted(http: httpx.Client, before: dict[str, int]) -> None:
    """The long generations since ``before`` were cut short and every block is free or cached."""
    after = wait_idle(http, timeout=10)
    assert after["num_generated_tokens"] - before["num_generated_tokens"] < 3000
    assert after["num_free_blocks"] + after["num_cached_blocks"] == after["num_kv_blocks"]


def test_cache_salt_isolates_tenants(client: openai.OpenAI) -> None:
    prompt = unique_text("tenant", 40)

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else None
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same tenant hits its own entries
    assert cached("tenant-b") == 0  # another tenant, same prompt: no cross hit
    assert cached(None) == 0  # nor does the default namespace
    assert cached("tenant-b") > 0


def test_sglang_extra_key_isolates_like_a_salt(client: openai.OpenAI, http: httpx.Client) -> None:
    """SGLang's ``extra_key`` keeps requests apart in the cache as SGLang's radix tree does (it
    was ignored: two tenants keyed apart shared cached KV)."""
    prompt = unique_text("extra-key", 40)

    def cached(**extra: str) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(extra_key="k1") == 0 and cached(extra_key="k1") > 0
    assert cached(extra_key="k2") == 0 and cached() == 0  # another key, and no key: apart
    assert cached(cache_salt="s", extra_key="k1") == 0  # a salt and a key: apart from each alone
    assert cached(cache_salt="s") == 0 and cached(cache_salt="s", extra_key="k1") > 0
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}, "extra_key": "k1"}
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] > 0  # SGLang's route: the same key


def test_32_concurrent_clients_get_their_greedy_outputs(server: LiveServer,
                                                        client: openai.OpenAI) -> None:
    shared = unique_text("conc-shared", 12)
    prompts = [f"{shared} q{i} " + unique_text(f"u{i}-", 2 + i % 5) for i in range(32)]
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        .choices[0].text
        for p in prompts[:8]
    ]

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                     timeout=120)
        async with aclient:
            async def one(i: int, p: str) -> str:
                if i % 2:  # half stream, half not
                    chunks = await aclient.completions.create(
                        model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True)
                    return "".join([c.choices[0].text async for c in chunks if c.choices])
                r = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=6,
                                                     temperature=0)
                return r.choices[0].text

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    got = asyncio.run(run_all())
    assert got[:8] == expected
    serial = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        .choices[0].text
        for p in prompts[8:]
    ]
    assert got[8:] == serial


def test_disconnect_mid_stream_frees_blocks(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = wait_idle(http)
        body = {"model": MODEL, "prompt": unique_text("gone", 30), "max_tokens": 3000,
                "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert got[0].startswith("data: ")
            running = http.get("/v1/cache/stats").json()
            assert running["num_running"] == 1
            assert running["num_free_blocks"] < before["num_free_blocks"]
        # Leaving the block closed the connection: the request is aborted, its blocks freed.
        _assert_aborted(http, before)


def test_chat_without_max_tokens_is_accepted(server: LiveServer) -> None:
    # Chat's default max_tokens is --default-chat-max-tokens capped by the room left in the
    # context / KV pool (test_server_hardening checks the cap); read the first chunk, then
    # hang up (which aborts the generation).
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
                "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            assert next(r.iter_lines()).startswith("data: ")
        wait_idle(http)


def test_disconnect_while_waiting_for_a_non_streaming_reply(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = wait_idle(http)
        body = {"model": MODEL, "prompt": unique_text("gone2", 30), "max_tokens": 3000,
                "temperature": 0}
        _post_and_leave(server.url + "/v1/completions", body)
        _assert_aborted(http, before)


def test_sglang_generate_clients_that_leave_are_aborted(server: LiveServer) -> None:
    # SGLang's /generate honours the same guarantee as the OpenAI routes, whole or streamed
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = wait_idle(http)
        body = {"text": unique_text("gone3", 30), "sampling_params": {"max_new_tokens": 3000, "temperature": 0,
                                                                     "ignore_eos": True}}
        _post_and_leave(server.url + "/generate", body)
        with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
        _assert_aborted(http, before)


def test_responses_and_messages_clients_that_leave_are_aborted(server: LiveServer) -> None:
    # the Responses and Messages APIs run on the chat path: a client that leaves is aborted
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = wait_idle(http)
        body = {"model": MODEL, "input": unique_text("gone4", 30), "max_output_tokens": 3000,
                "temperature": 0}
        _post_and_leave(server.url + "/v1/responses", body)
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines) == "event: response.created"
            assert any(line == "event: response.output_text.delta" for line in lines)
        anthropic_body = {"model": MODEL, "max_tokens": 3000, "stream": True,
                          "messages": [{"role": "user", "content": unique_text("gone5", 30)}]}
        with http.stream("POST", "/v1/messages", json=anthropic_body) as r:  # Anthropic's too
            assert any(line == "event: content_block_delta" for line in r.iter_lines())
        _assert_aborted(http, before)
