"""Issue 43 through ``prefixkv route``: the retention fields a client sends (Anthropic's
``cache_control``, OpenAI's ``prompt_cache_retention``, ``priority``) and the admin pin's
``ttl_s`` / ``priority`` reach a real worker unchanged, and its usage numbers come back; a
``cache_control`` mark does not change where a prompt is routed.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from prefixkv.cli import main
from prefixkv.router.keys import messages_key
from prefixkv.router.local import free_port
from prefixkv.wire.fanout import worker_rows


@pytest.fixture(scope="module")
def router() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "route", "--launch", "1", "--port", str(port),
         "--worker-args", "--num-kv-blocks 128 --block-size 16 --log-level warning",
         "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _retained(url: str, salt: str) -> int:
    stats = httpx.get(url + "/v1/cache/stats", timeout=30).json()
    rows = worker_rows(stats)
    bodies = [r["body"] for r in rows] if rows is not None else [stats]
    return sum(t["retained_blocks"] for b in bodies for t in b["tenants"] if t["cache_salt"] == salt)


def test_cache_control_through_the_router(router: str) -> None:
    salt = f"rt-{uuid.uuid4().hex}"
    system = " ".join(f"rtsys{i}" for i in range(40))
    client = anthropic.Anthropic(base_url=router, api_key="unused", max_retries=0, timeout=60)

    def ask(q: str) -> Any:
        return client.messages.create(
            model="prefixkv-demo", max_tokens=2, extra_body={"cache_salt": salt},
            system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            messages=[{"role": "user", "content": q}]).usage

    first, second = ask("first question"), ask("second question")
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 0
    assert first.cache_creation.ephemeral_1h_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert _retained(router, salt) == first.cache_creation_input_tokens // 16


def test_openai_retention_and_admin_retain_through_the_router(router: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    salt = f"ro-{uuid.uuid4().hex}"
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=60)
    client.chat.completions.create(
        model="prefixkv-demo", max_tokens=1, prompt_cache_retention="24h", prompt_cache_key="s1",
        messages=[{"role": "user", "content": " ".join(f"ro{i}" for i in range(40))}],
        extra_body={"cache_salt": salt, "priority": 5})
    assert _retained(router, salt) > 0
    text = " ".join(f"rpin{i}" for i in range(30))
    assert main(["cache", "pin", "--url", router, "--text", text, "--cache-salt", salt + "-pin",
                 "--ttl", "120", "--priority", "40"]) == 0
    assert "retained" in capsys.readouterr().out
    assert _retained(router, salt + "-pin") > 0


def test_cache_control_marks_leave_the_route_key_alone() -> None:
    text = {"type": "text", "text": "a long shared system prompt"}
    marked = {**text, "cache_control": {"type": "ephemeral", "ttl": "5m"}}
    user = [{"role": "user", "content": "hi"}]
    plain = messages_key({"system": [text], "messages": user})
    assert messages_key({"system": [marked], "messages": user}) == plain
    assert messages_key({"system": [text], "messages": user,
                         "cache_control": {"type": "ephemeral"}}) == plain
