"""Bad input gets a 400 (404 for an unknown model) with an OpenAI-style body, and the server
keeps serving; ``--api-key`` gives 401 without the key."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_live import API_KEY, BLOCK_SIZE, MODEL, NUM_KV_BLOCKS, LiveServer

CHAT = [{"role": "user", "content": "hi"}]

BAD_COMPLETIONS = [
    ("invalid json", '{"prompt": "x",', None),
    ("not an object", "[1, 2]", None),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("prompt mistyped", {"prompt": 3}, "prompt"),
    ("prompt token ids mistyped", {"prompt": [1, "a"]}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("max_tokens zero", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("max_tokens float", {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ("temperature negative", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("temperature mistyped", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("top_p zero", {"prompt": "x", "top_p": 0}, "top_p"),
    ("n zero", {"prompt": "x", "n": 0}, "n"),
    ("stop mistyped", {"prompt": "x", "stop": 5}, "stop"),
    ("stream mistyped", {"prompt": "x", "stream": "yes"}, "stream"),
    ("logprobs over the cap", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("logprobs negative", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("echo mistyped", {"prompt": "x", "echo": "yes"}, "echo"),
    ("presence_penalty out of range", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("repetition_penalty zero", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("logit_bias key not a token id", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias id out of vocabulary", {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("min_p over one", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("ignore_eos mistyped", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ("best_of above n", {"prompt": "x", "best_of": 3}, "best_of"),
    ("suffix", {"prompt": "x", "suffix": "tail"}, "suffix"),
    ("continuous_usage_stats mistyped",
     {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "y"}},
     "stream_options.continuous_usage_stats"),
    ("bad response_format", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
    ("bad json schema", {"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ("two output constraints",
     {"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}},
     None),
    ("token id out of vocabulary", {"prompt": [10**6]}, "prompt"),
    ("prompt longer than the context", {"prompt": "y" * 9000}, "prompt"),
    ("prompt longer than the KV pool", {"prompt": "z" * (NUM_KV_BLOCKS * BLOCK_SIZE + 100)},
     "prompt"),
    ("prompt + max_tokens over the context", {"prompt": "w" * 8000, "max_tokens": 500}, "prompt"),
]

BAD_CHATS = [
    ("missing messages", {"model": MODEL}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("content mistyped", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("tool without function", {"messages": CHAT, "tools": [{"type": "function"}]},
     "tools[0].function"),
    ("tool_choice without tools", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("tool_choice names no tool", {"messages": CHAT, "tool_choice": {
        "type": "function", "function": {"name": "nope"}},
        "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("top_logprobs without logprobs", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("logprobs mistyped", {"messages": CHAT, "logprobs": 3}, "logprobs"),
    ("max_completion_tokens zero", {"messages": CHAT, "max_completion_tokens": 0},
     "max_completion_tokens"),
    # a key of chat_template_kwargs that clashes with an argument was a 500
    ("template kwargs set messages", {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("template kwargs flag mistyped", {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": 1}},
     "chat_template_kwargs"),
    ("continue and add_generation_prompt", {"messages": CHAT, "continue_final_message": True},
     "continue_final_message"),
    ("continue without text", {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
        "continue_final_message": True, "add_generation_prompt": False}, "messages"),
]


def _assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param
    return err


@pytest.mark.parametrize(("case", "body", "param"), BAD_COMPLETIONS,
                         ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_is_400(http: httpx.Client, case: str, body: object,
                               param: str | None) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    for stream in (False, True):
        if stream and isinstance(body, dict):
            if "stream" in body or "stream_options" in body:
                continue
            content = json.dumps({**body, "stream": True})
        elif stream:
            continue
        r = http.post("/v1/completions", content=content,
                      headers={"content-type": "application/json"})
        _assert_error(r, 400, param)


@pytest.mark.parametrize(("case", "body", "param"), BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_is_400(http: httpx.Client, case: str, body: dict, param: str) -> None:
    _assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_unknown_model_is_404(http: httpx.Client, client: openai.OpenAI) -> None:
    err = _assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
                        404, "model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=1)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _assert_error(http.get("/v1/nothing"), 404, None)
    _assert_error(http.get("/v1/completions"), 405, None)


def test_server_keeps_serving_after_bad_input(http: httpx.Client, client: openai.OpenAI) -> None:
    for body in ("{", '{"prompt": "' + "q" * 9000 + '"}', '{"prompt": []}'):
        http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert http.get("/health").json() == {"status": "ok"}
    r = client.completions.create(model=MODEL, prompt="still alive", max_tokens=2)
    assert r.usage.completion_tokens == 2
    stats = http.get("/v1/cache/stats").json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_api_key_required(auth_server: LiveServer) -> None:
    url = auth_server.url
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        err = _assert_error(r, 401, None)
        assert err["type"] == "authentication_error"
    _assert_error(httpx.get(url + "/v1/models"), 401, None)
    _assert_error(httpx.get(url + "/v1/cache/stats"), 401, None)
    _assert_error(httpx.post(url + "/reset_prefix_cache"), 401, None)
    assert httpx.get(url + "/health").status_code == 200  # probes stay open
    assert httpx.get(url + "/ping").status_code == httpx.post(url + "/ping").status_code == 200  # vLLM's alias
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=1).usage
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
