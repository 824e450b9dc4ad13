"""LoRA adapters through the server (issue 44): the openai SDK picks an adapter by model name,
/v1/models lists it with its parent, vLLM's runtime load/unload routes, under concurrent load."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from server_live import MODEL, LiveServer, start_server

from prefixkv.engine import AsyncEngine, SamplingParams
from prefixkv.engine.lora import LoRARequest

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def make_adapter(base: Path, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, dict[str, Path]]]:
    from prefixkv.models.demo import ensure_demo_model

    base = ensure_demo_model()
    root = tmp_path_factory.mktemp("adapters")
    paths = {"sql": make_adapter(base, root / "sql", 1), "chat": make_adapter(base, root / "chat", 2)}
    engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=256, dtype="float32",
                                   enable_lora=True, lora_modules=[f"sql={paths['sql']}"])
    live = start_server(engine, model_name=MODEL)
    yield live, paths
    live.stop()
    engine.shutdown()


def offline(live: LiveServer, prompt: str, lora: LoRARequest | None) -> list[int]:
    """The engine's own greedy tokens for ``prompt`` (the reference for the HTTP answers)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run() -> list[int]:
        out = None
        async for out in live.engine.generate(prompt, params, lora_request=lora):
            pass
        assert out is not None
        return list(out.outputs[0].token_ids)

    import asyncio
    return asyncio.run(run())


def test_the_openai_client_picks_adapters_by_model_name(
        lora_server: tuple[LiveServer, dict[str, Path]]) -> None:
    live, paths = lora_server
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "sql"}
    assert models["sql"].model_extra["parent"] == MODEL and models[MODEL].model_extra["parent"] is None
    prompt = "SELECT name FROM users WHERE " * 4
    texts = {}
    for model in (MODEL, "sql"):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        texts[model] = r.choices[0].model_extra["token_ids"]
    assert texts["sql"] == offline(live, prompt, LoRARequest("sql", 1, str(paths["sql"])))
    assert texts[MODEL] == offline(live, prompt, None) != texts["sql"]
    # the adapter's blocks are its own: the base model's request cached nothing for it
    again = client.completions.create(model="sql", prompt=prompt + "x", max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chat = client.chat.completions.create(model="sql", max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_runtime_load_and_unload_under_concurrent_requests(
        lora_server: tuple[LiveServer, dict[str, Path]]) -> None:
    live, paths = lora_server
    failures: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"model": "sql", "prompt": "abc " * 20,
                                                        "max_tokens": 3})
                if r.status_code != 200:
                    failures.append(r.text)

    workers = [threading.Thread(target=traffic) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            load = http.post("/v1/load_lora_adapter",
                             json={"lora_name": "chat", "lora_path": str(paths["chat"])})
            assert load.status_code == 200 and "chat" in load.text
            assert http.post("/v1/load_lora_adapter", json={
                "lora_name": "chat", "lora_path": str(paths["chat"])}).status_code == 400
            r = http.post("/v1/completions", json={"model": "chat", "prompt": "hello " * 10,
                                                   "max_tokens": 3})
            assert r.status_code == 200, r.text
            bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
            gone = http.post("/v1/completions", json={"model": "chat", "prompt": "x", "max_tokens": 1})
            assert gone.status_code == 404
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert not failures


def test_metrics_export_vllms_lora_requests_info(
        lora_server: tuple[LiveServer, dict[str, Path]]) -> None:
    live, _ = lora_server
    done = threading.Event()

    def slow() -> None:  # a long request on the adapter, running while /metrics is read
        httpx.post(f"{live.url}/v1/completions", timeout=120, json={
            "model": "sql", "prompt": "q " * 30, "max_tokens": 200, "ignore_eos": True})
        done.set()

    t = threading.Thread(target=slow)
    t.start()
    try:
        seen = ""
        for _ in range(200):
            text = httpx.get(f"{live.url}/metrics").text
            line = next((x for x in text.splitlines()
                         if x.startswith("vllm:lora_requests_info{")), "")
            if 'running_lora_adapters="sql"' in line:
                seen = line
                break
            if done.is_set():
                break
        assert 'max_lora="4"' in seen and 'waiting_lora_adapters=""' in seen, seen
    finally:
        t.join()
    idle = httpx.get(f"{live.url}/metrics").text
    assert 'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}' in idle


def test_sglang_generate_takes_lora_path_per_prompt(
        lora_server: tuple[LiveServer, dict[str, Path]]) -> None:
    live, paths = lora_server
    prompt = "SELECT id FROM t WHERE " * 4
    body = {"text": [prompt, prompt], "lora_path": ["sql", None],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{live.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ids = [row["output_ids"] for row in r.json()]
    assert ids[0] == offline(live, prompt, LoRARequest("sql", 1, str(paths["sql"])))
    assert ids[1] == offline(live, prompt, None)
    for bad in ({**body, "lora_path": "nope"}, {**body, "lora_path": ["sql"]}):
        r = httpx.post(f"{live.url}/generate", json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    chat = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "lora_path": "sql"})
    assert chat.status_code == 400  # the OpenAI routes pick adapters by model name


def test_every_answer_names_the_adapter_it_ran_on(
        lora_server: tuple[LiveServer, dict[str, Path]]) -> None:
    """vLLM's: a request for an adapter is answered with ``model`` the adapter's name (the base
    model's name otherwise), whole and streamed, on completions, chat, Responses and Messages."""
    anthropic = pytest.importorskip("anthropic")
    live, _ = lora_server
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=60)
    messages: Any = [{"role": "user", "content": "Which model answers?"}]
    for model in ("sql", MODEL):
        seen = [client.completions.create(model=model, prompt="Hi", max_tokens=2).model,
                client.chat.completions.create(model=model, messages=messages, max_tokens=2).model,
                client.responses.create(model=model, input="Hi", max_output_tokens=2).model,
                claude.messages.create(model=model, messages=messages, max_tokens=2).model]
        seen += [c.model for c in client.completions.create(
            model=model, prompt="Hi", max_tokens=2, stream=True)]
        seen += [c.model for c in client.chat.completions.create(
            model=model, messages=messages, max_tokens=2, stream=True)]
        seen += [e.response.model for e in client.responses.create(
            model=model, input="Hi", max_output_tokens=2, stream=True) if hasattr(e, "response")]
        seen += [e.message.model for e in claude.messages.create(
            model=model, messages=messages, max_tokens=2, stream=True) if e.type == "message_start"]
        assert len(seen) >= 10 and set(seen) == {model}, (model, seen)


def test_a_gguf_lora_loads_at_run_time_and_answers_as_its_peft_original(
        lora_server: tuple[LiveServer, dict[str, Path]], tmp_path: Path) -> None:
    """vLLM's runtime route takes llama.cpp's GGUF LoRA file (``--lora-modules`` takes the
    same paths): the file converted from the ``sql`` adapter answers with ``sql``'s tokens."""
    pytest.importorskip("gguf")
    from gguf_lora_writer import write_gguf_lora

    from prefixkv.models.demo import DEMO_CONFIG

    live, paths = lora_server
    path = write_gguf_lora(paths["sql"], tmp_path / "sql.gguf", "qwen3", DEMO_CONFIG["num_hidden_layers"])
    body = {"prompt": "SELECT id FROM t WHERE " * 3, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(base_url=live.url, timeout=60) as http:
        load = http.post("/v1/load_lora_adapter", json={"lora_name": "sql-gguf", "lora_path": str(path)})
        assert load.status_code == 200, load.text
        try:
            got = {m: http.post("/v1/completions", json={**body, "model": m}).json()
                   for m in ("sql", "sql-gguf")}
        finally:
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql-gguf"}).status_code == 200
    assert got["sql-gguf"]["model"] == "sql-gguf"
    assert got["sql-gguf"]["choices"][0]["token_ids"] == got["sql"]["choices"][0]["token_ids"]
