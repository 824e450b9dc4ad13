"""The sampling features through the ``openai`` client against a live server: logprobs, echo
with prompt logprobs (equal on a cached prompt and a cold server), penalties, structured
outputs and forced tool calls, continuous usage, and vLLM's tokenizer and model routes."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from server_live import MODEL, LiveServer, start_server

from prefixkv.engine import AsyncEngine

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(len(t) >= 3 for t in lp.top_logprobs)
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_logprobs_on_a_cached_prompt_equal_a_cold_server(client: openai.OpenAI, server: LiveServer) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)  # caches the prompt
    warm = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2, echo=True)
    cold_engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=64, enable_prefix_caching=False)
    cold_server = start_server(cold_engine, model_name=MODEL)
    try:
        cold_client = openai.OpenAI(base_url=cold_server.url + "/v1", api_key="x", max_retries=0)
        cold = cold_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2, echo=True)
    finally:
        cold_server.stop()
        cold_engine.shutdown()
    w, c = warm.choices[0], cold.choices[0]
    assert w.text == c.text and w.text.startswith(PROMPT)
    assert w.logprobs.tokens == c.logprobs.tokens
    assert w.logprobs.token_logprobs[0] is None
    assert w.logprobs.token_logprobs[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)
    assert warm.usage.prompt_tokens_details.cached_tokens == 0  # computed, not read from cache


def test_logprob_tokens_as_token_ids(client: openai.OpenAI) -> None:
    """vLLM's ``return_tokens_as_token_ids``: every logprob token is named ``token_id:<id>`` (it
    was ignored: clients parsing the ids got text)."""
    ids = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    generated = (ids.model_extra or {})["token_ids"]
    assert ids.logprobs.tokens == [f"token_id:{t}" for t in generated]
    assert all(k.startswith("token_id:") for top in ids.logprobs.top_logprobs for k in top)
    assert ids.logprobs.text_offset == [sum(len(t) for t in ids.logprobs.tokens[:i]) for i in range(4)]  # vLLM's
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True}).choices[0]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0, logprobs=True, top_logprobs=2).choices[0]
    assert [e.token.startswith("token_id:") for e in chat.logprobs.content] == [True] * 3
    assert [e.bytes for e in chat.logprobs.content] == [e.bytes for e in plain.logprobs.content]  # still the text's
    assert [e.logprob for e in chat.logprobs.content] == [e.logprob for e in plain.logprobs.content]


def test_echo_with_max_tokens_zero(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="abc def", max_tokens=0, echo=True, logprobs=1)
    assert r.choices[0].text == "abc def" and r.usage.completion_tokens == 0
    assert len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens


def test_logprob_tokens_of_multibyte_text_join_up_to_it(client: openai.OpenAI) -> None:
    # the demo tokenizer has one token a byte: "é" is two tokens, "世" three. Each token reads as
    # the text it adds (vLLM's), so tokens join up to the text and text_offset indexes into it
    # (each token had read "\ufffd", and the offsets ran past the text)
    prompt = "héllo 世界!"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == prompt
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=24, temperature=0, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    if chat.choices[0].finish_reason == "stop":
        content = content[:-1]  # the EOS token's entry ("<|im_end|>"), not in the text
    text = "".join(c.token for c in content)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == text
    assert chat.choices[0].message.content == text


def test_chat_continues_the_final_message_and_template_kwargs_win(http: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "Give JSON."}, {"role": "assistant", "content": '{"a": '}]
    tokenized = http.post("/tokenize", json={"messages": msgs, "continue_final_message": True,
                                            "add_generation_prompt": False}).json()
    body = {"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0}
    cont = http.post("/v1/chat/completions", json={**body, "continue_final_message": True,
                                                   "add_generation_prompt": False}).json()
    assert cont["usage"]["prompt_tokens"] == tokenized["count"]
    # the same through chat_template_kwargs (vLLM: its keys win); clashing keys were a 500
    via = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {
        "continue_final_message": True, "add_generation_prompt": False}}).json()
    assert via["usage"]["prompt_tokens"] == cont["usage"]["prompt_tokens"]
    assert via["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # the same prompt, cached
    assert via["choices"][0]["message"] == cont["choices"][0]["message"]
    closed = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": False}).json()
    assert closed["usage"]["prompt_tokens"] > cont["usage"]["prompt_tokens"]  # the turn closed


def test_return_token_ids_whole_and_streamed(http: httpx.Client) -> None:
    # vLLM's return_token_ids (RL and agent loops feed ids back instead of re-tokenizing):
    # generated ids on each choice / delta, the prompt's beside them; a multi-byte character
    # split over byte tokens still sends every id, text or not
    body = {"model": MODEL, "prompt": "héllo 世界", "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()
    choice = whole["choices"][0]
    tokenized = http.post("/tokenize", json={"prompt": "héllo 世界"}).json()["tokens"]
    assert choice["prompt_token_ids"] == tokenized and len(choice["token_ids"]) == 6
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokenized
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "世界"}], "max_tokens": 5, "temperature": 0,
            "return_token_ids": True}
    whole = http.post("/v1/chat/completions", json=chat).json()
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"]
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]


def test_truncate_prompt_tokens_and_add_special_tokens(http: httpx.Client, server: LiveServer) -> None:
    # vLLM's fields: keep the last k prompt tokens (-1: the context length); tokenize a text
    # prompt without the tokenizer's special tokens (a pre-templated prompt: no second BOS)
    body = {"model": MODEL, "prompt": "abcdefghij", "max_tokens": 1, "temperature": 0, "echo": True}
    cut = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 4}).json()
    assert cut["usage"]["prompt_tokens"] == 4 and cut["choices"][0]["text"].startswith("ghij")
    head = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 4, "truncation_side": "right"}).json()
    text = head["choices"][0]["text"]  # vLLM's right side: the first k tokens, echoed
    assert head["usage"]["prompt_tokens"] == 4 and text.startswith("abc") and not text.startswith("abcdef")
    chat_special = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                            "max_tokens": 1, "add_special_tokens": True})
    assert chat_special.status_code == 400 and chat_special.json()["error"]["param"] == "add_special_tokens"
    whole = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == 10
    msgs = [{"role": "user", "content": "x" * 50}]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1,
                                                   "truncate_prompt_tokens": 8}).json()
    assert chat["usage"]["prompt_tokens"] == 8
    bad = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    tok = server.engine.tokenizer
    plain = http.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
    assert plain["usage"]["prompt_tokens"] == len(tok.encode("abcdefghij", add_special_tokens=False))


def test_request_ids_from_the_body_or_the_header(http: httpx.Client) -> None:
    # vLLM's: the response id carries the client's id (the router forwards X-Request-Id), so a
    # request can be followed through logs; two requests with one id both run
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    r = http.post("/v1/completions", json={**body, "request_id": "trace-1"}).json()
    assert r["id"] == "cmpl-trace-1"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-2"}).json()
    assert r["id"] == "chatcmpl-trace-2"
    with http.stream("POST", "/v1/completions", json={**body, "stream": True, "request_id": "same"}) as a:
        b = http.post("/v1/completions", json={**body, "request_id": "same"})
        assert b.status_code == 200 and b.json()["id"] == "cmpl-same"
        assert all(json.loads(x[6:])["id"] == "cmpl-same" for x in a.iter_lines() if x.startswith("data: {"))
    assert http.post("/v1/completions", json={**body, "request_id": "has space"}).status_code == 400
    odd = http.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 300})
    assert odd.status_code == 200 and odd.json()["id"].startswith("cmpl-") and "x" * 300 not in odd.json()["id"]


def test_streamed_logprobs_and_continuous_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=6, temperature=0, logprobs=1, stream=True, echo=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    with_text = [c for c in chunks if c.choices]
    assert with_text[0].choices[0].text.startswith("Hi")
    tokens = [t for c in with_text for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert len(tokens) == 2 + 6  # the echoed prompt "Hi" (2 byte tokens), then 6 generated
    assert all(c.usage is not None for c in with_text)
    assert [c.usage.completion_tokens for c in with_text] == sorted(c.usage.completion_tokens for c in with_text)
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_logprobs_streamed_and_whole(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    streamed = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    tokens = [c.token for ch in streamed if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]


def test_penalties_bias_and_stop_fields(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=32, temperature=0)
    assert len(set(base.choices[0].text)) < 32  # it repeats itself, so penalties bite
    z = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(ord("z")): 100})
    assert z.choices[0].text == "zzzz"
    pen = client.completions.create(model=MODEL, prompt="Hello", max_tokens=32, temperature=0, presence_penalty=2.0, frequency_penalty=2.0,
                                    extra_body={"repetition_penalty": 2.0, "min_p": 0.1, "top_k": 5})
    assert pen.choices[0].text != base.choices[0].text
    stop = base.choices[0].text[2:4]
    kept = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop)
    only = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.0,
                                     extra_body={"allowed_token_ids": [ord("a"), ord("b")], "ignore_eos": True})
    assert set(only.choices[0].text) <= {"a", "b"} and len(only.choices[0].text) == 6
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"allowed_token_ids": [10**6]})
    assert bad.value.body["param"] == "allowed_token_ids"  # type: ignore[index]
    eos = client.completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0,
                                    extra_body={"ignore_eos": True, "min_tokens": 9, "skip_special_tokens": False})
    assert eos.usage.completion_tokens == 9


def test_sglang_fields_on_the_openai_routes_are_honoured(client: openai.OpenAI) -> None:
    """SGLang clients send ``regex``, ``ebnf``, ``stop_regex`` and ``no_stop_trim`` to the OpenAI
    routes too: each takes effect (they were ignored with a warning, a silent wrong answer)."""
    rx = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0, extra_body={"regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", rx.choices[0].text)
    eb = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y/n?"}], max_tokens=8,
                                        extra_body={"ebnf": 'root ::= "yes" | "no"'})
    assert eb.choices[0].message.content in {"yes", "no"}
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    pattern = re.escape(base[4]) + "." + re.escape(base[6])
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_regex": [pattern]}).choices[0]
    assert cut.finish_reason == "stop" and (cut.model_extra or {})["stop_reason"] == pattern
    assert re.search(pattern, cut.text) and base.startswith(cut.text) and len(cut.text) < len(base)
    stop = base[2:4]
    kept = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"no_stop_trim": True})
    assert kept.choices[0].text.endswith(stop)
    for extra, param in [({"stop_regex": "("}, "stop_regex"), ({"stop_regex": ["a?"]}, "stop_regex"),
                         ({"regex": "a", "guided_regex": "b"}, "regex")]:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body=extra)
        assert bad.value.body["param"] == param, (extra, bad.value.body)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="grammar"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"ebnf": "root ::= ("})
    js = client.completions.create(model=MODEL, prompt="JSON", max_tokens=40, extra_body={"json_schema": json.dumps(SCHEMA)})
    assert json.loads(js.choices[0].text)["size"] in {"S", "M", "L"}  # SGLang's completions field


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
          "required": ["ok", "size"], "additionalProperties": False}


def test_response_format_json_schema_and_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=40,
                                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert json.loads(r.choices[0].message.content)["size"] in {"S", "M", "L"}
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in {"yes", "no"}


def test_forced_tool_calls(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "set_size", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": False}}}]
    msgs = [{"role": "user", "content": "call it"}]
    named = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "set_size"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "set_size" and json.loads(call.function.arguments)["size"] in {"S", "M", "L"}
    req = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, tools=tools, tool_choice="required",
                                         parallel_tool_calls=False)
    assert req.choices[0].finish_reason == "tool_calls"
    assert req.choices[0].message.tool_calls[0].function.name in {"set_size", "other"}
    streamed = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, tools=tools, stream=True,
                                                   tool_choice={"type": "function", "function": {"name": "set_size"}}))
    calls = [tc for ch in streamed if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and json.loads(calls[0].function.arguments)["ok"] in {True, False}
    auto = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, tools=tools, tool_choice="auto")
    assert auto.choices[0].message.content is not None


def test_tokenizer_routes(http: httpx.Client, server: LiveServer) -> None:
    t = http.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == server.engine.max_model_len
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "héllo"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    info = http.get("/tokenizer_info").json()
    assert "eos_token" in info and info["chat_template"]
    assert http.get("/version").json()["version"]
    assert http.post("/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400


def test_models_routes(http: httpx.Client, engine: AsyncEngine) -> None:
    live = start_server(engine, model_name=MODEL, served_model_names=("alias-a", "alias-b"))
    try:
        data = httpx.get(live.url + "/v1/models").json()["data"]
        assert [m["id"] for m in data] == [MODEL, "alias-a", "alias-b"]
        assert all(m["max_model_len"] == engine.max_model_len for m in data)
        assert httpx.get(live.url + "/v1/models/alias-b").json()["id"] == "alias-b"
        assert httpx.get(live.url + "/v1/models/nope").status_code == 404
        r = httpx.post(live.url + "/v1/completions", json={"model": "alias-a", "prompt": "x", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
    finally:
        live.stop()


def _unused(x: Any) -> Any:  # keep imports used when tests are deselected
    return x
