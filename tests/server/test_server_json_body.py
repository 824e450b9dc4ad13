"""Request bodies decode with msgspec where it can and ``json`` where it cannot: the same values,
the same errors, on the routes that take the largest bodies (completions, chat, ``/generate``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from server_live import LiveServer

from prefixkv.engine.sampling_params import MAX_LOGIT_BIAS_TOKENS
from prefixkv.server.errors import APIError
from prefixkv.server.json_body import (MAX_LOGIT_BIAS_JSON_BYTES, FastJSONRoute,
                                       check_logit_bias_bytes, decode)

BODIES = [
    b'{"prompt": "caf\\u00e9 \\ud83d\\ude00", "max_tokens": 1, "temperature": 0.1}',
    b'{"a": NaN, "b": Infinity, "c": -Infinity}',  # json's extensions: msgspec refuses them
    b'{"a": "\\ud800"}',  # a lone surrogate
    b'{"a": 123456789012345678901234567890, "b": 1.5e400, "c": -0.0, "d": 1e-320}',
    b'{"a": 1, "a": 2}',
    b'[[[[[[[[[[1]]]]]]]]]]',
    b'"just a string"',
]


@pytest.mark.parametrize("body", BODIES)
def test_decode_gives_what_json_loads_gives(body: bytes) -> None:
    ours, theirs = decode(body), json.loads(body)
    assert repr(ours) == repr(theirs)  # repr: NaN != NaN, and -0.0 == 0.0


@pytest.mark.parametrize("body", [b'{"a": ', b"", b"{'a': 1}", b'{"a": 1} x'])
def test_invalid_json_raises_what_json_loads_raises(body: bytes) -> None:
    with pytest.raises(json.JSONDecodeError) as ours:
        decode(body)
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(body)
    assert str(ours.value) == str(theirs.value)


def _api_routes(routes: list[Any]) -> list[APIRoute]:
    """Every APIRoute of an app, through included routers (FastAPI keeps those unflattened)."""
    out: list[APIRoute] = []
    for r in routes:
        if isinstance(r, APIRoute):
            out.append(r)
        elif getattr(r, "original_router", None) is not None:
            out += _api_routes(r.original_router.routes)
    return out


def test_the_big_body_routes_decode_with_msgspec(server: LiveServer) -> None:
    routes = {r.path: r for r in _api_routes(server.server.config.app.routes)}
    for path in ("/completions", "/chat/completions", "/generate"):
        assert isinstance(routes[path], FastJSONRoute), path


def test_requests_and_bad_bodies_answer_as_before(http: httpx.Client) -> None:
    ok = http.post("/v1/completions", json={"prompt": "caf\u00e9", "max_tokens": 2,
                                            "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    bad = http.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                    headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    nan = http.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                    headers={"content-type": "application/json"})
    assert nan.status_code == 400 and "temperature" in nan.text
    gen = http.post("/generate", json={"text": "caf\u00e9", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0}})
    assert gen.status_code == 200 and gen.json()["meta_info"]["completion_tokens"] == 2


BIG_BIAS = {str(i): 1.0 for i in range(100_000)}  # 1.4 MB of JSON


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "logit_bias": BIG_BIAS}, "logit_bias"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": BIG_BIAS}},
     "sampling_params.logit_bias"),
])
def test_an_oversized_logit_bias_is_refused_from_its_raw_json(body: dict[str, Any], param: str) -> None:
    """Refused before decoding builds its 100k entries (13 ms on the event loop)."""
    with pytest.raises(APIError, match=f"logit_bias holds at most {MAX_LOGIT_BIAS_TOKENS} entries") as err:
        check_logit_bias_bytes(json.dumps(body).encode())
    assert err.value.param == param and err.value.status == 400


@pytest.mark.parametrize("body", [
    # the most a valid one holds, its ids and values at their longest, pretty-printed
    json.dumps({"prompt": "x" * 300_000, "logit_bias": {
        str(151_000 + i): -1.2345678901234567e-05 for i in range(MAX_LOGIT_BIAS_TOKENS)}},
        indent=8).encode(),
    json.dumps({"prompt": "word " * 200_000}).encode(),  # big, no bias
    json.dumps([{"logit_bias": BIG_BIAS}]).encode(),  # not an object: the route answers
    b'{"logit_bias": NaN, "prompt": "' + b"x" * 300_000 + b'"}',  # only json reads it
])
def test_what_could_be_valid_is_left_to_the_route(body: bytes) -> None:
    assert len(body) > MAX_LOGIT_BIAS_JSON_BYTES
    check_logit_bias_bytes(body)


def test_the_generate_route_refuses_a_big_nested_bias_naming_it(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1,
                                                                       "logit_bias": BIG_BIAS}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "sampling_params.logit_bias" and "not read" in err["message"]
