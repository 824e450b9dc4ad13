"""Issue 44: the router keeps one adapter's requests on the worker that cached them.

Three real prefixkv workers serve the same two LoRA adapters (``--enable-lora --lora-modules``)
on the demo model. A shared system prompt is sent for adapter ``a`` and for ``b``; every later
request of an adapter (the same system prompt, another question) goes to the worker that holds
that adapter's blocks, and reads them from its cache. The base model's blocks of the same text
(computed on another worker, sent there directly) are no reason to go anywhere: an adapter's
blocks are only useful to its own requests (they are keyed by the adapter's weights), and the
``precise`` policy, whose index holds base-model blocks only, must not take the base model's
blocks of the prompt for the adapter's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from prefixkv.bench.route.replay import ready
from prefixkv.models.demo import DEMO_CONFIG
from prefixkv.router.app import WORKER_HEADER, RouterConfig, RouterServer
from prefixkv.router.local import LAUNCHED_KV_EVENTS, LocalWorkers
from prefixkv.router.precise import PrecisePolicy
from prefixkv.wire.kv_events import block_hashes

BLOCK = 8


def random_adapter(out: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT-format LoRA on the demo model's q/v projections, random weights."""
    c = DEMO_CONFIG
    h, d = c["hidden_size"], c["head_dim"]
    shapes = {"q_proj": (h, c["num_attention_heads"] * d), "v_proj": (h, c["num_key_value_heads"] * d)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for proj, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(shapes)}))
    return out


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalWorkers]:
    root = tmp_path_factory.mktemp("adapters")
    args = ["--num-kv-blocks", "256", "--block-size", str(BLOCK), "--log-level", "warning",
            "--kv-events-config", LAUNCHED_KV_EVENTS, "--enable-lora", "--lora-modules",
            f"a={random_adapter(root / 'a', 1)}", f"b={random_adapter(root / 'b', 2)}"]
    with LocalWorkers(3, None, args) as lw:
        asyncio.run(ready(lw.urls, timeout=120))
        yield lw


def complete(url: str, model: str | None, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0,
            **({"model": model} if model else {})}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def wait_for_blocks(policy: PrecisePolicy, worker: str, hashes: list[int], urls: list[str]) -> None:
    deadline = time.monotonic() + 30
    while policy.index.match(hashes, urls)[worker] < len(hashes) - 1:
        assert time.monotonic() < deadline, "the base model's blocks never reached the index"
        time.sleep(0.02)


@pytest.mark.parametrize("policy", ["cache_aware", "precise"])
def test_an_adapters_requests_stay_on_the_worker_that_cached_it(
        workers: LocalWorkers, policy: str) -> None:
    config = RouterConfig(worker_urls=tuple(workers.urls), policy=policy,
                          health_check_interval=0.5, health_check_timeout=2.0)
    system = f"[{policy}] You answer as the adapter you are, in one short line. " * 4
    with RouterServer(config) as router:
        holder = {m: complete(router.url, m, system + f"First question for {m}?").headers[WORKER_HEADER]
                  for m in ("a", "b")}
        # the base model's blocks of the same system prompt on a worker holding no adapter's
        # (sent there directly, so the router did not choose it)
        other = next((u for u in workers.urls if u not in holder.values()), workers.urls[0])
        complete(other, None, system + "A base model question?")
        if isinstance(router.router.policy, PrecisePolicy):
            ids = httpx.post(f"{other}/tokenize", json={"prompt": system}).json()["tokens"]
            wait_for_blocks(router.router.policy, other, block_hashes(ids, BLOCK), workers.urls)
        system_tokens = len(httpx.post(f"{workers.urls[0]}/tokenize", json={"prompt": system}).json()["tokens"])
        for i in range(3):
            for model in ("a", "b"):
                resp = complete(router.url, model, system + f"Question {i} for {model}?")
                assert resp.headers[WORKER_HEADER] == holder[model], (model, i)
                cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached >= system_tokens // BLOCK * BLOCK - BLOCK  # its own blocks, read


def test_a_model_name_no_worker_lists_is_not_looked_up_on_every_request() -> None:
    """A client sending made-up model names must not make each request cost the router a
    ``/v1/models`` call: an unlisted name is asked again only after a while."""
    import asyncio

    import httpx

    from prefixkv.router.cache_aware import CacheAwarePolicy
    from prefixkv.router.precise import PrecisePolicy

    asked: list[bytes] = []
    models = (b'{"object": "list", "data": [{"id": "base", "parent": null}, '
              b'{"id": "sql", "parent": "base"}]}')

    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                asked.append(head.split(b" ")[1])
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(models)).encode() + b"\r\n\r\n" + models)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        now = [0.0]
        policy = PrecisePolicy([url], CacheAwarePolicy([url]), clock=lambda: now[0])
        async with httpx.AsyncClient() as client:
            assert await policy._is_adapter(client, url, "sql", None)
            assert not await policy._is_adapter(client, url, "base", None)
            for _ in range(5):
                assert not await policy._is_adapter(client, url, "made-up", None)
            assert len(asked) == 2  # "sql" (which taught "base" too) and "made-up" once
            now[0] = 11.0  # later, it may have been loaded since: asked again
            assert not await policy._is_adapter(client, url, "made-up", None)
            assert len(asked) == 3
        server.close()

    asyncio.run(asyncio.wait_for(main(), 20))
