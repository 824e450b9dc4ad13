"""SGLang's native API on the live server: ``/generate`` (text, ids, batches, ``n``, streaming,
stops, structured output, ``max_new_tokens`` 0, logprobs), ``meta_info.cached_tokens`` after a
shared prefix, ``/flush_cache`` and ``/model_info``, and its errors."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from server_live import MODEL, start_server

from prefixkv.engine import AsyncEngine

PREFIX = "You are a helpful assistant. Keep it short. " * 6


def generate(http: httpx.Client, **body: Any) -> Any:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_text_ids_and_cached_tokens(http: httpx.Client) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    assert http.post("/flush_cache").text.startswith("Cache flushed.")
    first = generate(http, text=PREFIX + "Hi", sampling_params=greedy)
    meta = first["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["completion_tokens"] == 6
    assert meta["cached_tokens"] == 0 and len(first["output_ids"]) == 6
    again = generate(http, text=PREFIX + "Hello", sampling_params=greedy)
    assert again["meta_info"]["cached_tokens"] >= 256  # the shared prefix came from the cache
    ids = http.post("/tokenize", json={"prompt": PREFIX + "Hi"}).json()["tokens"]
    by_ids = generate(http, input_ids=ids, sampling_params=greedy)
    assert by_ids["output_ids"] == first["output_ids"] and by_ids["text"] == first["text"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
    batch = generate(http, text=["a", "b"], sampling_params=greedy)
    assert isinstance(batch, list) and len(batch) == 2
    samples = generate(http, text="x", sampling_params={"n": 3, "max_new_tokens": 2, "sampling_seed": 1})
    assert len(samples) == 3 and len({s["meta_info"]["id"] for s in samples}) == 3
    assert http.get("/flush_cache").status_code == 403  # a GET flushes only with the admin key
    assert http.post("/flush_cache").status_code == 200
    series = 'prefixkv:request_success_total{finished_reason="length",model_name="prefixkv-demo"}'

    def finished() -> float:  # /generate requests count in the server's metrics too
        line = next((x for x in http.get("/metrics").text.splitlines() if x.startswith(series)), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    before = finished()
    generate(http, text=["p", "q"], sampling_params=greedy)
    assert finished() == before + 2
    assert generate(http, text=PREFIX + "Hello", sampling_params=greedy)["meta_info"]["cached_tokens"] == 0


def test_generate_stream_stop_and_structured(http: httpx.Client) -> None:
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    whole = generate(http, text="Hello", sampling_params=params)
    with http.stream("POST", "/generate", json={"text": "Hello", "sampling_params": params, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each event: the text so far
    stop = whole["text"][2:4]
    cut = generate(http, text="Hello", sampling_params={**params, "stop": stop})
    assert cut["text"] == whole["text"][:2] and cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = generate(http, text="Hello", sampling_params={**params, "stop": stop, "no_stop_trim": True})
    assert kept["text"] == whole["text"][:4]
    rx = generate(http, text="?", sampling_params={"regex": "[0-9]{3}", "max_new_tokens": 8, "temperature": 0})
    assert len(rx["text"]) == 3 and rx["text"].isdigit()
    eb = generate(http, text="?", sampling_params={"ebnf": 'root ::= "yes" | "no"', "max_new_tokens": 8, "temperature": 0})
    assert eb["text"] in {"yes", "no"}
    pattern = re.escape(whole["text"][3]) + "." + re.escape(whole["text"][5])
    rs = generate(http, text="Hello", sampling_params={**params, "stop_regex": [pattern]})
    assert rs["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}  # SGLang's shape
    assert re.search(pattern, rs["text"]) and whole["text"].startswith(rs["text"])


def test_generate_errors_name_the_field(http: httpx.Client) -> None:
    for body, param in [({}, None), ({"text": "x", "input_ids": [1]}, None),
                        ({"text": "x", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
                        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
                        ({"text": "x", "return_logprob": True, "token_ids_logprob": [10**7]}, "token_ids_logprob"),
                        ({"text": "x", "return_logprob": True, "token_ids_logprob": [1] * 129}, "token_ids_logprob"),
                        ({"text": "x", "sampling_params": {"stop_regex": "("}}, "sampling_params"),
                        ({"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "sampling_params"),
                        ({"text": "x", "sampling_params": {"ebnf": "root ::= ("}}, "sampling_params.ebnf"),
                        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
                        ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
                        ({"text": "x", "image_data": "http://x/cat.png"}, "image_data"),  # not dropped
                        ({"input_ids": [10**7]}, "input_ids"),
                        # the OpenAI routes' limits hold here too (n=100000 would be 100,000 sequences)
                        ({"text": "x", "sampling_params": {"n": 100_000}}, "sampling_params.n"),
                        ({"text": ["x"] * 100_000}, "text")]:
        r = http.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    assert http.get("/health_generate").status_code == 200  # a real one-token generation
    server = http.get("/server_info").json()
    assert server["page_size"] > 0 and server["max_total_num_tokens"] >= server["page_size"]
    assert server["disable_radix_cache"] is False and http.get("/get_server_info").json()["dp_size"] == 1
    info = http.get("/model_info").json()
    assert info["model_path"] == MODEL and info["is_generation"] is True
    assert http.get("/get_model_info").json() == info


def test_generate_logprobs_as_sglang_frontend_select_asks(http: httpx.Client) -> None:
    """SGLang's frontend ``select``: cache the prompt (``max_new_tokens`` 0), then score each
    choice from two tokens before its end: the prompt up to there is read from the cache, the
    logprobs after it equal the prompt logprobs of the OpenAI route (computed whole)."""
    prompt = PREFIX + "Pick one:"
    cached = generate(http, text=prompt, sampling_params={"max_new_tokens": 0, "min_new_tokens": 4})
    assert cached["text"] == "" and cached["output_ids"] == []
    assert cached["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert cached["meta_info"]["completion_tokens"] == 0
    start = cached["meta_info"]["prompt_tokens"] - 2
    body = {"text": [prompt + c for c in (" red", " blue")], "return_logprob": True,
            "logprob_start_len": start, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
    scored = generate(http, **body)
    for item, choice in zip(scored, (" red", " blue")):
        meta = item["meta_info"]
        assert meta["cached_tokens"] == start  # read up to the start, computed after it
        ids = http.post("/tokenize", json={"prompt": prompt + choice}).json()["tokens"]
        assert [e[1] for e in meta["input_token_logprobs"]] == ids[start:]
        assert meta["input_token_logprobs"][0][0] is None  # SGLang's: nothing before the first
        assert [e[2] for e in meta["input_token_logprobs"]] == [
            http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids[start:]]
        assert meta["output_token_logprobs"] == [] and "input_top_logprobs" not in meta
        ref = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + choice, "echo": True,
                                                  "logprobs": 1, "max_tokens": 1}).json()
        want = ref["choices"][0]["logprobs"]["token_logprobs"][start + 1 : len(ids)]
        got = [e[0] for e in meta["input_token_logprobs"][1:]]
        assert got == [pytest.approx(w, abs=1e-4) for w in want]
    # generated tokens: their logprobs and the top k, without texts unless asked
    out = generate(http, text="Hello", return_logprob=True, top_logprobs_num=2,
                   sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []  # start -1: output only
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(e[2] is None and e[0] <= 0 for e in meta["output_token_logprobs"])
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 2 and top[0][1] == chosen[1] and top[0][0] == chosen[0] >= top[1][0]  # greedy: rank 1
    with http.stream("POST", "/generate", json={"text": "Hello", "stream": True, "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                   "ignore_eos": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]  # so far, each event


def test_token_ids_logprob_scores_labels_at_every_position(http: httpx.Client) -> None:
    """SGLang's ``token_ids_logprob`` (vLLM's ``logprob_token_ids`` on the OpenAI routes): per
    prompt position from ``logprob_start_len`` and per generated token, those ids' logprobs in
    the order given, equal to what the OpenAI route reports for the same greedy request."""
    labels = [ord("N"), ord("Y")]
    prompt = "Yes or no? "
    out = generate(http, text=prompt, return_logprob=True, logprob_start_len=3, token_ids_logprob=labels,
                   sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    meta = out["meta_info"]
    outs = meta["output_token_ids_logprobs"]
    assert len(outs) == 3 and all([e[1] for e in pos] == labels and all(e[0] <= 0 for e in pos) for pos in outs)
    ins = meta["input_token_ids_logprobs"]
    assert len(ins) == len(meta["input_token_logprobs"]) and ins[0] is None  # nothing before the start
    assert all([e[1] for e in pos] == labels for pos in ins[1:])
    ref = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True, "logprobs": 5, "logprob_token_ids": labels}).json()
    tops = ref["choices"][0]["logprobs"]["top_logprobs"]
    assert [set(t) >= {"N", "Y"} and len(t) <= 3 for t in tops] == [True] * 3  # the chosen and exactly the labels
    assert [[e[0] for e in pos] for pos in outs] == [[pytest.approx(t[chr(i)], abs=1e-5) for i in labels] for t in tops]
    zero = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "logprobs": 0,
                                              "logprob_token_ids": labels}).json()  # logprobs 0 is set
    assert {"N", "Y"} <= set(zero["choices"][0]["logprobs"]["top_logprobs"][0])
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "logprob_token_ids": labels})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_token_ids"  # vLLM: needs logprobs
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                                   # greedy: a sampled first token could be a lone UTF-8 byte,
                                                   # after which "N" adds "\ufffdN" (texts are in context)
                                                   "max_tokens": 2, "temperature": 0,
                                                   "logprobs": True, "logprob_token_ids": labels}).json()
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert {"N", "Y"} <= {c["token"] for c in entry["top_logprobs"]} and len(entry["top_logprobs"]) <= 3


def test_health_generate_is_503_when_the_engine_is_gone() -> None:
    engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=16)
    live = start_server(engine)
    try:
        assert httpx.get(live.url + "/health_generate", timeout=30).status_code == 200
        engine.shutdown()
        assert httpx.get(live.url + "/health_generate", timeout=30).status_code == 503
        assert httpx.get(live.url + "/health", timeout=30).status_code == 503
    finally:
        live.stop()
        engine.shutdown()
