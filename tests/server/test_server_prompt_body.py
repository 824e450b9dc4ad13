"""Issue 40: a body too big for any one-prompt request is refused from its Content-Length, 413,
before the server reads it (a 10 MB chat body was read and parsed on the event loop: its
neighbours waited 64-286 ms); batch routes keep --max-request-body-bytes as their bound."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx

from prefixkv.server.prompt_body import ONE_PROMPT_ROUTES, prompt_body_cap

BIG = "word " * 2_000_000  # 10 MB


def _cap(http: httpx.Client) -> int:
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    return prompt_body_cap(max_model_len, 16 << 20)


def test_every_one_prompt_route_refuses_a_10_mb_body_unread(http: httpx.Client) -> None:
    cap = _cap(http)
    assert cap < 10_000_000
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": BIG}]},
              "/v1/messages": {"messages": [{"role": "user", "content": BIG}], "max_tokens": 1},
              "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": BIG}]},
              "/v1/responses": {"input": BIG}, "/tokenize": {"prompt": BIG},
              "/v1/chat/completions/render": {"messages": [{"role": "user", "content": BIG}]}}
    assert set(bodies) == set(ONE_PROMPT_ROUTES)
    for path, body in bodies.items():
        start = time.perf_counter()
        r = http.post(path, content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and f"{cap:,}-byte limit of POST {path}" in err[
            "message"]
        assert time.perf_counter() - start < 5


def test_the_refusal_comes_before_the_body_is_sent(server) -> None:  # type: ignore[no-untyped-def]
    """Headers only, declaring 10 MB: the 413 arrives although no byte of the body was sent."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n")
        answer = s.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 413") and "request_too_large" in answer


def test_a_chunked_body_is_cut_off_at_the_cap(http: httpx.Client) -> None:
    cap = _cap(http)

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(cap // (1 << 20) + 2):
            yield b"w" * (1 << 20)
        yield b'"}'

    r = http.post("/tokenize", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "not read" in r.json()["error"]["message"]


def test_bodies_under_the_cap_and_batch_routes_are_read_as_before(http: httpx.Client) -> None:
    under = {"messages": [{"role": "user", "content": "word " * 600_000}]}  # 3 MB: parsed
    r = http.post("/v1/chat/completions", json=under)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json={"prompt": "word " * 100_000, "max_tokens": 1})  # batch
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # read: the length guard
    assert http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


def test_the_cap_follows_the_context_and_never_passes_the_body_limit() -> None:
    assert prompt_body_cap(8192, 16 << 20) == 8192 * 32 * 12 + (4 << 20)
    assert prompt_body_cap(131072, 16 << 20) == 16 << 20
    assert prompt_body_cap(8192, 1 << 20) == 1 << 20
