"""guidellm and aiperf against a live ``prefixkv serve --model smollm2-135m-instruct``, counting
tokens with the tokenizer directory the catalogue writes (no model hub).

Opt-in: both clients live in their own venv (``scripts/install-bench-clients.sh``); these tests
run when ``PREFIXKV_BENCH_CLIENTS`` names its ``bin`` directory (or the clients are on PATH) and
skip otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_live import wait_for_health

from prefixkv.models.catalog import tokenizer_dir

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"


def _find(name: str) -> str | None:
    where = os.environ.get("PREFIXKV_BENCH_CLIENTS")
    return shutil.which(name, path=where) if where else shutil.which(name)


def _client(name: str) -> str:
    found = _find(name)
    if found is None:
        pytest.skip(f"{name} is not installed (scripts/install-bench-clients.sh, then "
                    f"PREFIXKV_BENCH_CLIENTS=VENV/bin)")
    return found


@pytest.fixture(scope="module")
def served(smol: Path) -> Iterator[str]:
    """``prefixkv serve --model smollm2-135m-instruct`` on a free loopback port (skips before
    starting it when neither client is installed)."""
    if _find("guidellm") is None and _find("aiperf") is None:
        pytest.skip("neither guidellm nor aiperf is installed (scripts/install-bench-clients.sh, "
                    "then PREFIXKV_BENCH_CLIENTS=VENV/bin)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "serve", "--model", NAME, "--port", str(port),
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, timeout=300)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done


def test_guidellm_benchmarks_the_real_model_with_the_exported_tokenizer(
    served: str, tmp_path: Path
) -> None:
    out = tmp_path / "guidellm.json"
    _run([_client("guidellm"), "run",
          "--backend", f"kind=openai_http,target={served},model={NAME}",
          "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir(NAME)}",
          "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
          "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=8",
          "--output", f"kind=json,path={out}", "--disable-console-interactive"], tmp_path)
    bench = json.loads(out.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"]) == (4, 0), totals


def test_aiperf_counts_prompt_tokens_as_the_server_does(served: str, tmp_path: Path) -> None:
    """aiperf tokenizes its synthetic prompts with the exported directory; on the completions
    route the server's ``usage.prompt_tokens`` must be the same count for every request."""
    # aiperf 0.13.0 resolves --tokenizer through the hub cache when HF_HUB_OFFLINE is set (a
    # local directory then fails), so the environment is left without it: nothing is fetched.
    art = tmp_path / "art"
    _run([_client("aiperf"), "profile", "--model", NAME, "--url", served,
          "--endpoint-type", "completions", "--tokenizer", str(tokenizer_dir(NAME)),
          "--request-count", "4", "--isl", "64", "--osl", "8", "--artifact-dir", str(art),
          "--ui-type", "none"], tmp_path)
    records = [json.loads(line) for line in (art / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 4 and not any(r.get("error") for r in records), records
    for r in records:
        m = r["metrics"]
        assert m["input_sequence_length"]["value"] == m["usage_prompt_tokens"]["value"] == 64, m
        assert m["output_sequence_length"]["value"] == 8
