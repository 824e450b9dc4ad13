"""The OpenAI routes through the official ``openai`` client against a live server."""

from __future__ import annotations

import httpx
import openai
from server_live import BLOCK_SIZE, MODEL, LiveServer, unique_text


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_non_streaming(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=unique_text("nc", 10), max_tokens=5,
                                  temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    prompt = unique_text("cs", 10)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage unless include_usage


def test_chat_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": unique_text("chat", 6)}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 6
    # The second identical chat reuses the cached prompt (all but the last token at most).
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - BLOCK_SIZE


def test_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = unique_text("long", 60)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = second.usage.prompt_tokens
    assert n > 200
    assert n - BLOCK_SIZE <= second.usage.prompt_tokens_details.cached_tokens < n
    assert first.choices[0].text == second.choices[0].text  # caching never changes output


def test_n_seed_and_batch_prompts(client: openai.OpenAI) -> None:
    p1, p2 = unique_text("b1", 5), unique_text("b2", 5)
    r = client.completions.create(model=MODEL, prompt=[p1, p2], n=2, max_tokens=4,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=[p1, p2], n=2, max_tokens=4,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded
    assert r.usage.completion_tokens == 16


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    prompt = unique_text("stop", 8)
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    text = free.choices[0].text
    stop = text[3:5]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_token_id_prompt_and_extensions(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": list(range(65, 65 + 40)), "max_tokens": 3,
            "temperature": 0, "top_k": 5, "stop_token_ids": [], "cache_salt": "ext"}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 40


def test_sse_wire_format(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": unique_text("sse", 4), "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_streaming_n2_matches_non_streaming(client: openai.OpenAI) -> None:
    prompt = unique_text("n2s", 6)
    kw = {"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 5, "temperature": 0.8,
          "seed": 3}
    full = client.completions.create(**kw)
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {0: "length", 1: "length"}
