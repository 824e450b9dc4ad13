"""Route keys: chunk hashes of the prompt text (or ids), namespaces, and what a match covers."""

from __future__ import annotations

import pytest

from prefixkv.router.keys import RouteKey, chat_key, chunk_offset, completion_key, text_key


def chat(*contents: str, model: str = "m") -> dict:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in zip(roles, contents)]}


def test_next_turn_extends_previous_turn_in_full_chunks() -> None:
    k1 = chat_key(chat("sys " * 40, "hello"))
    k2 = chat_key(chat("sys " * 40, "hello", "hi!", "how are you"))
    full = len(k1) - 1  # all but the trailing partial chunk
    assert len(k2) > len(k1) and k2.chunks[:full] == k1.chunks[:full]
    assert k1.namespace == k2.namespace


def test_text_is_chunked_not_per_byte() -> None:
    # 32 chunks of 16 bytes (512), then 32 of 32 (1 KB), then 64-byte chunks
    assert [chunk_offset(i, 16) for i in (0, 1, 32, 33, 64, 65)] == [0, 16, 512, 544, 1536, 1600]
    key = text_key("x" * 16_384, None, 16)
    assert len(key) == 161 and key.size == 16_384 and key.unit == 16
    assert len(text_key("x" * (1 << 20), None, 16)) < 360  # a few hundred, not a million
    assert all(0 <= c < 2**32 for c in key.chunks)
    assert len(text_key("x" * 17, None, 16)) == 2  # the trailing partial chunk counts too
    # a match stopping inside the prompt is credited with half the next chunk
    assert key.covered(3) == 48 + 8 and key.covered(32) == 512 + 16
    assert key.covered(0) == 0 and key.covered(161) == key.covered(10**6) == 16_384
    assert key.ratio(32) == 528 / 16_384 and RouteKey("n", ()).ratio(0) == 0.0


def test_content_parts_render_like_plain_text() -> None:
    parts = {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}
    ]}
    assert chat_key(parts) == chat_key({"model": "m", "messages": [{"role": "user", "content": "abc"}]})


def test_completion_keys_and_namespaces() -> None:
    text = completion_key({"model": "m", "prompt": "héllo"})
    assert text.size == len("héllo".encode()) and len(text) == 1
    assert completion_key({"model": "m", "prompt": ["héllo", "x"]}) == text
    ids = completion_key({"model": "m", "prompt": list(range(40))}, 64)
    assert ids.size == 40 and ids.unit == 16 and len(ids) == 3  # 16 ids per chunk, then 2 more
    assert ids.namespace != text.namespace
    assert completion_key({"model": "m", "prompt": 3}).chunks == ()
    assert completion_key({"model": "n", "prompt": "héllo"}).namespace != text.namespace
    salted = completion_key({"model": "m", "prompt": "héllo", "cache_salt": "t1"})
    assert salted.namespace != text.namespace
    keyed = completion_key({"model": "m", "prompt": "héllo", "cache_salt": "t1", "extra_key": "k"})
    assert keyed.namespace not in (salted.namespace, text.namespace)  # SGLang's extra_key: apart too
    assert completion_key({"prompt": "\ud800x"}).size == 4  # a lone surrogate does not crash


def test_keys_are_stable_across_calls_and_distinct_for_distinct_text() -> None:
    assert text_key("abc" * 50, None) == text_key("abc" * 50, None)
    assert text_key("abc" * 50, None).chunks != text_key("abd" * 50, None).chunks


def test_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        text_key("x", None, 2)


def test_generate_key_is_the_completion_key_of_its_text_or_ids() -> None:
    # SGLang's /generate body keys as the same prompt would through /v1/completions
    from prefixkv.router.keys import completion_key, generate_key

    assert generate_key({"text": "hello " * 40}) == completion_key({"prompt": "hello " * 40})
    assert generate_key({"input_ids": [1, 2, 3] * 40}) == completion_key({"prompt": [1, 2, 3] * 40})
    assert generate_key({"text": ["a " * 40, "b"]}) == completion_key({"prompt": ["a " * 40, "b"]})
    salted = generate_key({"text": "x " * 40, "cache_salt": "t1"})
    assert salted == completion_key({"prompt": "x " * 40, "cache_salt": "t1"}) != generate_key({"text": "x " * 40})
