"""``prefixkv serve`` as a real process (README examples run against it, idle connections kept
for ``--timeout-keep-alive``, SIGTERM stops it), ``prefixkv generate`` offline, and a server
with prefix caching off."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_live import start_server, wait_for_health

from prefixkv.cli import build_parser, main
from prefixkv.engine import AsyncEngine
from prefixkv.cli.serve import KEEP_ALIVE_S

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for argv in (["serve", "--help"], ["cache", "pin", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--block-size", "--num-kv-blocks", "--no-enable-prefix-caching", "--index",
                 "--eviction-policy", "--hash-algo", "--max-pinned-blocks", "--api-key",
                 "--tokens", "--description", "--max-tokens"):
        assert flag in out, flag


def _response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length body, or b"" when the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        body += chunk
    return head


def _answers_after_idle(port: int, idle_s: float) -> bool:
    """Whether one keep-alive connection, idle ``idle_s`` after a first request, answers a
    second (the server closes it after its ``--timeout-keep-alive``)."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        assert _response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(idle_s)
        try:
            sock.sendall(request)
            return _response(sock).startswith(b"HTTP/1.1 200")
        except OSError:
            return False


def test_keep_alive_outlasts_the_clients_idle_expiry() -> None:
    """httpx (the OpenAI SDK's transport) drops an idle connection after 5 s: a server that
    closes it first races the client's next request (a reset, ReadError)."""
    assert KEEP_ALIVE_S > httpx.Limits().keepalive_expiry
    args = build_parser().parse_args(["serve"])
    assert args.timeout_keep_alive == KEEP_ALIVE_S
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--timeout-keep-alive", "0"])


def test_serve_process_runs_examples_and_stops_on_sigterm() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFIXKV_BASE_URL": url, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "serve", "--port", str(port),
         "--num-kv-blocks", "512", "--log-level", "warning", "--timeout-keep-alive", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(url, proc)
        assert _answers_after_idle(port, 0.3)  # kept while idle under 2 s
        assert not _answers_after_idle(port, 3.0)  # closed by the server after 2 s
        run = subprocess.run([sys.executable, "examples/openai_client.py"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "cached" in run.stdout
        if shutil.which("curl") and shutil.which("bash"):
            run = subprocess.run(["bash", "examples/curl.sh"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120, check=False)
            assert run.returncode == 0, run.stdout + run.stderr
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal (exit status -SIGTERM).
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
        out = proc.stdout.read() if proc.stdout else ""
        assert "prefixkv: engine stopped" in out, out
        assert "objects frozen for the garbage collector" in out, out  # --freeze-gc, the default
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_generate_offline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Hello, prefix cache!", "--max-tokens", "4", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["token_ids"]) == 4 and record["finish_reason"] == "length"
    assert main(["generate", "x", "--max-tokens", "0"]) == 1
    assert "max_tokens" in capsys.readouterr().err


def test_server_without_prefix_caching() -> None:
    engine = AsyncEngine.from_args(None, enable_prefix_caching=False, num_kv_blocks=64)
    live = start_server(engine)
    try:
        body = {"prompt": "no cache here " * 10, "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        r = httpx.post(live.url + "/v1/cache/pin", json={"text": "x" * 40})
        assert r.status_code == 409 and r.json()["error"]["code"] == "prefix_caching_disabled"
        stats = httpx.get(live.url + "/v1/cache/stats").json()
        assert stats["enable_prefix_caching"] is False and stats["cache"] is None
        assert "prefixkv:num_requests_running" in httpx.get(live.url + "/metrics").text
    finally:
        live.stop()
        engine.shutdown()


FREEZE_PROBE = """
import gc, weakref
from prefixkv.engine import LLM
from prefixkv.cli.serve import freeze_heap
llm = LLM()
frozen = freeze_heap()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after the freeze: the collector still frees it
gone = weakref.ref(a)
del a, b
gc.collect()
print(frozen, gc.get_freeze_count() == frozen, gone() is None)
"""


def test_freeze_heap_leaves_later_garbage_collectable() -> None:
    """What the server loaded is frozen (tens of thousands of objects: torch, the model);
    a reference cycle made afterwards is still collected."""
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    frozen, same, collected = out.stdout.split()
    assert int(frozen) > 10_000 and same == "True" and collected == "True"
