"""Issue 40: a batch route's body that holds one string longer than any field could be is cut
(413) while it is still arriving, so a 10 MB prompt is not read, joined and decoded on the event
loop; token-id batches, however long, are never cut."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.server.limits import PROMPT_CHARS_PER_TOKEN
from prefixkv.server.string_guard import (
    NON_PROMPT_STRING_CHARS,
    LongString,
    StringScan,
    string_char_limit,
)

BIG = "word " * 2_000_000  # 10 MB

LIMIT, CHECKPOINT = 64, 16  # small, so generated bodies reach them


def scan(body: bytes, cuts: list[int], limit: int = LIMIT, checkpoint: int = CHECKPOINT) -> LongString | None:
    """Feed ``body`` split at ``cuts``; the first long string found."""
    s = StringScan(limit, checkpoint)
    edges = [0, *sorted(c % (len(body) + 1) for c in cuts), len(body)]
    found = None
    for a, b in zip(edges, edges[1:]):
        found = s.feed(body[a:b]) or found
    return found


def longest_string(value: object) -> int:
    """The most characters of any string (key or value) in a decoded JSON document."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return max([0, *(max(len(k), longest_string(v)) for k, v in value.items())])
    if isinstance(value, list):
        return max([0, *(longest_string(v) for v in value)])
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8"), max_size=150),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(json_values, st.booleans(), st.lists(st.integers(0, 10**6), max_size=6))
def test_the_decision_is_the_same_for_every_split_and_only_ever_names_a_real_long_string(
        value: object, ascii_only: bool, cuts: list[int]) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    whole = scan(body, [])
    assert scan(body, cuts) == whole  # how the body arrived does not matter
    if whole is not None:  # sound: the document holds a string at least that long
        assert longest_string(value) >= whole.chars > LIMIT


@pytest.mark.parametrize("text", ["w" * 200, "é" * 200, "😀" * 200, "a\\b\n" * 60])
def test_a_long_string_is_found_whatever_its_characters(text: str) -> None:
    for ascii_only in (True, False):
        body = json.dumps({"prompt": text}, ensure_ascii=ascii_only).encode()
        found = scan(body, [7, 101])
        if len(text) - 5 * body.count(b"\\") > LIMIT + CHECKPOINT:  # the bound's guarantee
            assert found is not None and LIMIT < found.chars <= len(text)
        assert found is None or found.chars <= len(text)


def test_token_id_batches_numbers_and_many_short_strings_are_never_cut() -> None:
    bodies = [json.dumps({"prompt": [[1, 22, 333] * 500] * 20, "max_tokens": 1}),
              json.dumps({"x": [1.5e10, -2, True, False, None] * 2000}),
              json.dumps({"stop": ["s" * 60] * 200, "user": "u" * 64})]
    for body in bodies:
        assert scan(body.encode(), [3, 500, 9000]) is None


def test_the_limit_is_the_longest_prompt_or_a_generous_field() -> None:
    assert string_char_limit(8192) == NON_PROMPT_STRING_CHARS  # 262,144 < 1 Mi
    assert string_char_limit(131072) == 131072 * PROMPT_CHARS_PER_TOKEN
    with pytest.raises(ValueError, match="checkpoint"):
        StringScan(10, checkpoint=11)


def _assert_cut(r: httpx.Response, path: str) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large"
    assert f"POST {path} holds a JSON string" in err["message"] and "not read" in err["message"]


def test_a_10_mb_prompt_on_a_batch_route_is_cut_and_the_server_goes_on(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": BIG, "max_tokens": 1})
    _assert_cut(r, "/v1/completions")
    r = http.post("/generate", json={"text": BIG, "sampling_params": {"max_new_tokens": 1}})
    _assert_cut(r, "/generate")
    r = http.post("/v1/completions", json={"prompt": ["hi", BIG], "max_tokens": 1})  # in a batch
    _assert_cut(r, "/v1/completions")
    ok = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json=ok).status_code == 200  # the same client
    with httpx.Client(base_url=str(http.base_url), timeout=60) as fresh:
        assert fresh.post("/v1/completions", json=ok).status_code == 200


def test_a_chunked_body_is_cut_while_it_arrives(server) -> None:  # type: ignore[no-untyped-def]
    """No Content-Length, 10 MB sent in 64 KiB chunks: the 413 comes back although most of the
    body was never read (the server answers and leaves the rest unread)."""
    def chunks() -> Iterator[bytes]:
        yield b'{"max_tokens": 1, "prompt": "'
        for _ in range(160):
            yield b"w" * (64 << 10)
        yield b'"}'

    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    _assert_cut(r, "/v1/completions")
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:  # and the server serves
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_a_big_token_id_batch_is_read_and_answered_as_before(http: httpx.Client) -> None:
    """~3 MB of token ids holds no string: it is read, parsed and run (the prefix cache makes
    the 200 identical prompts cheap)."""
    body = {"prompt": [[1] * 5000] * 200, "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()["choices"]) == 200 and r.json()["usage"]["prompt_tokens"] == 1_000_000
