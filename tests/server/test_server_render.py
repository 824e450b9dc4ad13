"""vLLM's render API (issue 42): the token ids a request would prefill, in vLLM's shape."""

from __future__ import annotations

import httpx
from server_live import MODEL, unique_text


def test_chat_render_gives_the_ids_the_chat_route_prefills(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": unique_text("render", 8)}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0,
            "cache_salt": "tenant-r", "stop": "\n"}
    r = http.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert set(rendered) == {"request_id", "token_ids", "features", "sampling_params", "model",
                             "stream", "stream_options", "cache_salt", "priority",
                             "kv_transfer_params"}
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == MODEL
    assert rendered["cache_salt"] == "tenant-r" and rendered["stream"] is False
    prio = http.post("/v1/chat/completions/render", json={**body, "priority": 7}).json()
    assert rendered["priority"] == 0 and prio["priority"] == 7  # the request's, as vLLM's
    sp = rendered["sampling_params"]
    assert sp["max_tokens"] == 5 and sp["temperature"] == 0 and sp["stop"] == ["\n"]
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    done = http.post("/v1/chat/completions", json=body).json()
    assert done["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    # nothing ran: rendering never fills the cache
    again = http.post("/v1/chat/completions/render", json=body).json()
    assert again["token_ids"] == rendered["token_ids"]


def test_completions_render_is_one_generate_request_per_prompt(http: httpx.Client) -> None:
    prompts = [unique_text("rc", 6), unique_text("rd", 9)]
    r = http.post("/v1/completions/render", json={"model": MODEL, "prompt": prompts,
                                                   "max_tokens": 3})
    assert r.status_code == 200, r.text
    rows = r.json()
    assert isinstance(rows, list) and len(rows) == 2
    for row, prompt in zip(rows, prompts):
        ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert row["token_ids"] == ids and row["request_id"].startswith("cmpl-")
        assert row["sampling_params"]["max_tokens"] == 3
    ids = http.post("/v1/completions/render", json={
        "prompt": [5, 6, 7, 8, 9], "truncate_prompt_tokens": 3}).json()[0]["token_ids"]
    assert ids == [7, 8, 9]


def test_render_refuses_what_the_route_refuses(http: httpx.Client) -> None:
    bad = http.post("/v1/chat/completions/render", json={"messages": [], "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    bad = http.post("/v1/completions/render", json={"prompt": "x", "temperature": -1})
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    unknown = http.post("/v1/completions/render", json={"prompt": "x", "model": "nope"})
    assert unknown.status_code == 404
