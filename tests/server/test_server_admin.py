"""Cache admin: pin / list / unpin / reset through the ``prefixkv cache`` CLI and HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_live import BLOCK_SIZE, MODEL, LiveServer, unique_text

from prefixkv.cli import main


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_pin_list_unpin_reset_round_trip(server: LiveServer,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--url", server.url)
    tokens = ",".join(str(t) for t in range(40, 40 + 2 * BLOCK_SIZE + 3))  # 2 full blocks
    code, out, _ = _cli(capsys, "cache", "pin", "--tokens", tokens, "--description",
                        "Default System Prompt", *url)
    assert code == 0 and "pinned 32 tokens (2 blocks)" in out
    code, out, _ = _cli(capsys, "cache", "list-pinned", *url)
    assert code == 0 and "Default System Prompt" in out and "40,41,42" in out
    code, out, _ = _cli(capsys, "cache", "list-pinned", "--json", *url)
    pinned = json.loads(out)["data"]
    assert [p["token_ids"] for p in pinned] == [list(range(40, 40 + 2 * BLOCK_SIZE))]
    code, out, _ = _cli(capsys, "cache", "stats", *url)
    assert code == 0 and "Hit Rate:" in out and "(2 pinned" in out

    # Text pins too; the pinned blocks survive as cache hits for a prompt that starts with it.
    system = unique_text("pin-sys", 20)
    code, out, _ = _cli(capsys, "cache", "pin", "--text", system, *url)
    assert code == 0
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL, prompt=system + " question", max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(system) // BLOCK_SIZE * BLOCK_SIZE

    code, out, _ = _cli(capsys, "cache", "unpin", "--tokens", tokens, *url)
    assert code == 0 and "unpinned" in out
    code, _, err = _cli(capsys, "cache", "unpin", "--tokens", tokens, *url)
    assert code == 1 and "not pinned" in err and len(err.strip().splitlines()) == 1
    code, out, _ = _cli(capsys, "cache", "reset", *url)
    assert code == 0 and "cache reset" in out
    code, out, _ = _cli(capsys, "cache", "list-pinned", *url)
    assert code == 0 and "no pinned prefixes" in out
    stats = httpx.get(server.url + "/v1/cache/stats").json()
    assert stats["cache"]["pinned_blocks"] == 0


def test_lookup_tells_what_a_request_would_read(server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = unique_text("lookup", 40)
    code, out, _ = _cli(capsys, "cache", "lookup", "--text", prompt, "--url", server.url)
    assert code == 0 and out.startswith("0 of ") and "(pool 0)" in out
    httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    found = httpx.post(server.url + "/v1/cache/lookup", json={"text": prompt + " and more"}).json()
    assert found["cached_tokens"] == found["tiers"]["pool"] >= len(prompt) - BLOCK_SIZE
    again = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt + " and more",
                                                              "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == found["cached_tokens"]
    salted = httpx.post(server.url + "/v1/cache/lookup", json={"text": prompt, "cache_salt": "t2"}).json()
    assert salted["cached_tokens"] == 0  # another tenant's namespace


def test_pin_messages_then_chat_hits(http: httpx.Client, client: openai.OpenAI) -> None:
    system = {"role": "system", "content": unique_text("chat-sys", 30)}
    r = http.post("/v1/cache/pin", json={"messages": [system], "description": "sys"})
    assert r.status_code == 200, r.text
    assert r.json()["num_blocks"] >= 2
    chat = client.chat.completions.create(
        model=MODEL, messages=[system, {"role": "user", "content": "hello"}], max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= r.json()["num_tokens"]
    assert http.post("/v1/cache/unpin", json={"messages": [system]}).status_code == 200
    assert http.post("/reset_prefix_cache").json()["reset"] is True


def test_admin_bad_input(http: httpx.Client) -> None:
    for body in ({}, {"token_ids": [1], "text": "x"}, {"token_ids": []}, {"text": 3},
                 {"token_ids": [1, 2], "extra": 1}):
        r = http.post("/v1/cache/pin", json=body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.post("/v1/cache/pin", json={"token_ids": [1, 2, 3]})  # shorter than a block
    assert r.status_code == 400 and "block" in r.json()["error"]["message"]


def test_reset_tiers_argument(http: httpx.Client, capsys: pytest.CaptureFixture[str],
                              server: LiveServer) -> None:
    """``tiers`` by query or body (the body passes through the router); this server has no lower
    tiers, so nothing below the pool is reported. Bad values are a 400 naming ``tiers``."""
    for r in (http.post("/v1/cache/reset?tiers=all"), http.post("/v1/cache/reset", json={"tiers": ["disk"]}),
              http.post("/reset_prefix_cache", json={"tiers": "none"})):
        assert r.status_code == 200 and r.json()["reset"] is True and r.json()["tiers"] == {}, r.text
    for bad in (http.post("/v1/cache/reset?tiers=gpu"), http.post("/v1/cache/reset", json={"tiers": 3}),
                http.post("/v1/cache/reset", content=b"{", headers={"content-type": "application/json"})):
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tiers", bad.text
    code, out, _ = _cli(capsys, "cache", "reset", "--tiers", "all", "--url", server.url)
    assert code == 0 and "cache reset" in out


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, "cache", "stats", "--url", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach the server" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, "cache", "pin", "--tokens", "1,x", "--url", "http://127.0.0.1:9")
    assert code == 1 and "--tokens" in err


PROXY_HEADERS = [("X-Real-IP", "203.0.113.7"), ("X-Forwarded-Host", "example.com"),
                 ("X-Forwarded-Proto", "https"), ("Forwarded", "for=203.0.113.7"),
                 ("Via", "1.1 nginx"), ("X-Client-IP", "203.0.113.7"),
                 ("CF-Connecting-IP", "203.0.113.7"), ("True-Client-IP", "203.0.113.7"),
                 ("X-Original-Forwarded-For", "203.0.113.7"),
                 ("X-Envoy-External-Address", "203.0.113.7")]


@pytest.mark.parametrize(("name", "value"), PROXY_HEADERS)
def test_any_proxy_header_means_not_local(http: httpx.Client, name: str, value: str) -> None:
    """(Was: only ``Forwarded`` / ``X-Forwarded-For`` counted, so a same-host proxy that sets
    ``X-Real-IP`` gave every remote user the admin routes.)"""
    assert http.get("/v1/cache/stats").status_code == 200  # the same client, direct
    for method, path in [("GET", "/v1/cache/stats"), ("POST", "/v1/cache/reset"),
                         ("POST", "/flush_cache")]:
        r = http.request(method, path, headers={name: value})
        assert r.status_code == 403, (name, path, r.text)
        err = r.json()["error"]
        assert err["code"] == "admin_only" and name.lower() in err["message"]


def _cached_blocks(http: httpx.Client) -> int:
    return int(http.get("/v1/cache/stats").json()["cache"]["cached_blocks"])


def test_get_flush_cache_needs_the_admin_key(http: httpx.Client) -> None:
    """(Was: ``GET /flush_cache`` flushed, so a page in a local browser could flush with an
    ``<img>`` tag.) Without an admin key it is a 403 that says to POST; nothing is flushed."""
    r = http.post("/v1/completions", json={"prompt": unique_text("flushget", 40), "max_tokens": 1})
    assert r.status_code == 200 and _cached_blocks(http) > 0
    before = _cached_blocks(http)
    r = http.get("/flush_cache")
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "post_required" and "POST" in err["message"]
    assert _cached_blocks(http) == before
    assert http.post("/flush_cache").text.startswith("Cache flushed.")
    assert _cached_blocks(http) == 0


def test_get_flush_cache_with_the_admin_key_is_served(engine: object) -> None:
    from server_live import start_server

    live = start_server(engine, admin_api_key="adm1n")  # type: ignore[arg-type]
    try:
        with httpx.Client(base_url=live.url, timeout=60) as c:
            assert c.get("/flush_cache").status_code == 401
            r = c.get("/flush_cache", headers={"Authorization": "Bearer adm1n"})
            assert r.status_code == 200 and r.text.startswith("Cache flushed.")
            r = c.get("/flush_cache", headers={"Authorization": "Bearer adm1n",
                                               "X-Real-IP": "203.0.113.7"})
            assert r.status_code == 200  # the key is the proof, wherever the caller is
    finally:
        live.stop()
