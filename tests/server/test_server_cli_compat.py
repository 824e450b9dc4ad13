"""vLLM's serve flags and seed 004's ``engine start`` spelling, on a real process; the
``cache pin`` messages about partial blocks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_live import wait_for_health

from prefixkv.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_engine_start_with_vllm_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[[{{ m['content'] }}]]{% endfor %}")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "engine", "start", "--port", str(port),
         "--prefix-cache-size", "64", "--prefix-cache-enable", "--eviction-policy", "lru",
         "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
         "--seed", "3", "--dtype", "auto", "--chat-template", str(template),
         "--served-model-name", "a", "b", "--strict-fields", "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(url, proc)
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["a", "b"] and models[0]["max_model_len"] == 512
        stats = httpx.get(url + "/v1/cache/stats").json()
        assert stats["num_kv_blocks"] == 64
        tok = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "[[hi]]"
        r = httpx.post(url + "/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 1, "frob": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frob"  # --strict-fields
        too_long = httpx.post(url + "/v1/completions", json={"prompt": "y" * 600, "max_tokens": 1})
        assert too_long.status_code == 400 and "512" in too_long.json()["error"]["message"]
        assert main(["cache", "pin", "--url", url, "--tokens", "1,2,3,4,5"]) == 0  # nothing to pin
        assert capsys.readouterr().out.startswith(
            "nothing pinned: the prefix is 5 tokens, shorter than one 16-token KV block")
        assert main(["cache", "pin", "--url", url, "--tokens", ",".join(str(i + 1) for i in range(21))]) == 0
        assert "the last 5 of the 21 tokens were not pinned" in capsys.readouterr().out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
