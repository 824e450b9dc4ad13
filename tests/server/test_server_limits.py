"""Request limits (issue 40, items 4, 5 and 10): bounded stop lists and biases, the length guard
on every prompt-taking route, lone surrogates and small error bodies, each a 400 naming its field."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from prefixkv.engine.sampling_params import MAX_LOGIT_BIAS_TOKENS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from prefixkv.server.errors import MAX_ERROR_MESSAGE_CHARS


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    err: dict[str, Any] = r.json()["error"]
    return err


@pytest.mark.parametrize(("field", "value"), [
    ("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
    ("stop", ["x" * 5000]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("logit_bias", {str(i): 1.0 for i in range(100_000)}),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_lists_and_biases_are_bounded(http: httpx.Client, path: str, field: str, value: Any) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = http.post(path, json={**body, "max_tokens": 1, "n": 64, field: value})
    err = _error(r)
    assert err["param"] == field
    assert len(r.content) < 4096  # was a 688 KB body for 100k logit_bias entries


def test_the_sglang_route_has_the_same_bounds(http: httpx.Client) -> None:
    for field, value in (("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
                         ("logit_bias", {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)})):
        r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, field: value}})
        assert f"{field} holds at most" in _error(r)["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_an_oversized_logit_bias_is_refused_before_its_entries_are_read(
    http: httpx.Client, path: str
) -> None:
    """The size bound runs before pydantic checks each entry (those checks held the event loop
    ~22 ms for 100k entries): entries that are not even numbers get the size error alone."""
    bias = {str(i): "not a number" for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}
    body: dict[str, Any] = (
        {"prompt": "hi", "max_tokens": 1, "logit_bias": bias} if path == "/v1/completions"
        else {"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": bias}})
    err = _error(http.post(path, json=body))
    assert f"logit_bias holds at most {MAX_LOGIT_BIAS_TOKENS} entries" in err["message"]
    assert "number" not in err["message"]


def test_the_bounds_admit_what_they_promise(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 2, "stop": [f"zz{i}" for i in range(MAX_STOP_STRINGS)],
        "logit_bias": {str(i): 0.0 for i in range(200)}})  # (the demo vocabulary has 259 ids)
    assert r.status_code == 200, r.text


def test_every_error_body_is_small(http: httpx.Client) -> None:
    """An error whose message would echo the request is cut (an unknown model of 1 MB here)."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "model": "m" * 1_000_000})
    assert len(_error(r, 404)["message"]) <= MAX_ERROR_MESSAGE_CHARS
    assert len(r.content) < MAX_ERROR_MESSAGE_CHARS + 512


BIG = "word " * 200_000  # 1 MB: far past the demo's 8,192-token context (262,144 characters),
# under the one-prompt routes' body cap (10 MB bodies: 413 unread, test_server_prompt_body.py)

HUGE = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/v1/messages", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 1}, "messages"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      "system": BIG}, "system"),
    ("/v1/responses", {"input": BIG}, "input"),
    ("/v1/responses", {"input": "hi", "instructions": BIG}, "instructions"),
    ("/tokenize", {"prompt": BIG}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/v1/completions/render", {"prompt": BIG}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "field"), HUGE, ids=[f"{p}:{f}" for p, _, f in HUGE])
def test_a_huge_prompt_is_refused_before_templating_on_every_route(
    http: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    raw = json.dumps(body).encode()  # encoded before the clock: this process hosts the server
    t0 = time.perf_counter()
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - t0
    err = _error(r)
    assert err["param"] == field and "far more than the model's context" in err["message"]
    assert elapsed < 5, elapsed  # was 16-56 s of templating and tokenizing (under 1 s when quiet)


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/tokenize", '{"prompt": "\\ud800x"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800x"}]}', "messages"),
    ("/v1/messages", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', "messages"),
    ("/v1/messages/count_tokens", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/responses", '{"input": "\\ud800"}', "input"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(http: httpx.Client, path: str, body: str, field: str) -> None:
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    err = _error(r)
    assert err["param"] == field and "not valid Unicode" in err["message"]
    assert http.post("/tokenize", json={"prompt": "still serving"}).status_code == 200


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w"}] * 100_000}, "messages"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "w"}] * 100_000, "max_tokens": 1}, "messages"),
    ("/v1/responses", {"input": [{"role": "user", "content": "w"}] * 100_000}, "input"),
    ("/tokenize", {"messages": [{"role": "user", "content": "w"}] * 100_000}, "messages"),
])
def test_a_body_of_many_tiny_messages_is_refused_early(
    http: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    err = _error(r)
    assert err["param"].startswith(field)
    if path != "/v1/responses":  # (a union field: its 400 says which shapes it accepts)
        assert "at most 4096" in err["message"]
