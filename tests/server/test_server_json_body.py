"""Request bodies decode with msgspec where it can and ``json`` where it cannot: the same values,
the same errors, on the routes that take the largest bodies (completions, chat, ``/generate``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from server_live import LiveServer

from prefixkv.server.json_body import FastJSONRoute, decode

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
