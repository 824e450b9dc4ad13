"""Requests whose content once took the whole server down, against ``prefixkv serve`` as a real
process (issue 40): each is a 4xx naming its field, and the same process serves after it.

A schema or grammar that is a long chain overflowed llguidance's native stack (SIGSEGV, every
request lost); a JSON string nested thousands deep raised ``RecursionError`` in the engine (a
503 "the engine is not running", which a router counts against the worker); 100k choices took
20-28 s and answered with a Rust panic's backtrace.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_live import wait_for_health

ROOT = Path(__file__).resolve().parents[2]


def ref_chain(n: int) -> dict[str, Any]:
    """A schema whose ``$ref`` points at a ``$ref`` ... ``n`` deep (~106 KB at 3,000)."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(n: int) -> str:
    """A Lark grammar of ``n`` rules, each the next one."""
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"\n'


def nested_string(n: int) -> str:
    return "[" * n + "]" * n


CHAT = {"model": "prefixkv-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL = {"model": "prefixkv-demo", "prompt": "hi", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": ref_chain(3000)}}

# (route, body, the field the 400 names): every way a request reaches the grammar compiler
CRASHERS: dict[str, tuple[str, dict[str, Any], str]] = {
    "completions guided_json $ref chain": ("/v1/completions", {**CMPL, "guided_json": ref_chain(3000)}, "guided_json"),
    "chat response_format $ref chain": ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}}}, "response_format"),
    "chat named tool $ref chain": ("/v1/chat/completions", {
        **CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    "chat required tools $ref chain": ("/v1/chat/completions", {
        **CHAT, "tools": [TOOL], "tool_choice": "required"}, "tools"),
    "messages tool input_schema $ref chain": ("/v1/messages", {
        "model": "prefixkv-demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": ref_chain(3000)}],
        "tool_choice": {"type": "tool", "name": "f"}}, "tools"),
    "completions guided_grammar rule chain": ("/v1/completions", {**CMPL, "guided_grammar": rule_chain(2800)}, "guided_grammar"),
    "chat structured_outputs.grammar rule chain": ("/v1/chat/completions", {
        **CHAT, "structured_outputs": {"grammar": rule_chain(2800)}}, "structured_outputs"),
    "sglang json_schema $ref chain": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "json_schema": json.dumps(ref_chain(3000))}}, "sampling_params.json_schema"),
    "sglang ebnf rule chain": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "ebnf": rule_chain(2800)}}, "sampling_params.ebnf"),
    "sglang regex deep groups": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "regex": "(" * 3000 + "a" + ")" * 3000}}, "sampling_params.regex"),
    # within the bounds, still too deep for the compiler: the guarded child crashes, not us
    "completions guided_json $ref chain under the bound": (
        "/v1/completions", {**CMPL, "guided_json": ref_chain(900)}, "guided_json"),
    "chat guided_grammar rule chain under the bound": (
        "/v1/chat/completions", {**CHAT, "guided_grammar": rule_chain(900)}, "guided_grammar"),
    # RecursionError: JSON strings nested deeper than Python's parser recurses
    "sglang json_schema nested string": ("/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "json_schema": nested_string(3000)}}, "sampling_params.json_schema"),
    "completions guided_json nested string": ("/v1/completions", {**CMPL, "guided_json": nested_string(3000)}, "guided_json"),
    "completions json_schema nested string": ("/v1/completions", {**CMPL, "json_schema": nested_string(3000)}, "json_schema"),
    "chat structured_outputs.json nested string": ("/v1/chat/completions", {
        **CHAT, "structured_outputs": {"json": nested_string(3000)}}, "structured_outputs"),
    # huge: 100k choices (was 20-28 s and a Rust panic), anyOf of 5,000 (was 5 s)
    "completions guided_choice 100k": ("/v1/completions", {
        **CMPL, "guided_choice": [f"choice {i}" for i in range(100_000)]}, "guided_choice"),
    "chat anyOf 5000": ("/v1/chat/completions", {**CHAT, "guided_json": {"anyOf": [
        {"type": "object", "properties": {f"p{i}": {"type": "integer"}}, "required": [f"p{i}"]}
        for i in range(5000)]}}, "guided_json"),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Server:
    """``prefixkv serve`` as a child process; started again if a test killed it (so each case
    shows its own failure on a server that crashes, and runs once on one that does not)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.http: httpx.Client | None = None

    def get(self) -> tuple[httpx.Client, subprocess.Popen[str]]:
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefixkv.cli", "serve", "--port", str(port),
                 "--num-kv-blocks", "64", "--log-level", "warning"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, text=True)
            wait_for_health(url, self.proc)
            self.http = httpx.Client(base_url=url, timeout=60)
        assert self.http is not None
        return self.http, self.proc

    def stop(self) -> None:
        if self.http is not None:
            self.http.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    holder = _Server()
    yield holder
    holder.stop()


@pytest.fixture
def served(server: _Server) -> tuple[httpx.Client, subprocess.Popen[str]]:
    return server.get()


def _serves(http: httpx.Client, proc: subprocess.Popen[str]) -> None:
    assert proc.poll() is None, f"the server died (exit {proc.returncode})"
    r = http.post("/v1/completions", json={**CMPL, "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("case", list(CRASHERS))
def test_a_request_that_crashed_the_compiler_is_a_400_and_the_server_lives(
        served: tuple[httpx.Client, subprocess.Popen[str]], case: str) -> None:
    http, proc = served
    route, body, field = CRASHERS[case]
    t0 = time.monotonic()
    try:
        r = http.post(route, json=body)
    except httpx.HTTPError as exc:
        pytest.fail(f"no answer ({exc!r}); server exit status {proc.poll()}")
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field, error
    message = error["message"]
    assert "\n" not in message and "backtrace" not in message and "panic" not in message, message
    assert "engine" not in message, message  # never "the engine is not running"
    assert took < 10, f"{case}: {took:.1f} s"
    _serves(http, proc)


def test_guided_choice_100k_is_refused_fast_with_the_cap(served: tuple[httpx.Client, subprocess.Popen[str]]) -> None:
    http, proc = served
    body = {**CMPL, "guided_choice": [f"choice {i}" for i in range(100_000)]}
    t0 = time.monotonic()
    r = http.post("/v1/completions", json=body)
    assert time.monotonic() - t0 < 3
    assert r.status_code == 400 and "at most 4,096" in r.json()["error"]["message"], r.text
    _serves(http, proc)


def test_json_schema_within_the_bounds_still_constrains(served: tuple[httpx.Client, subprocess.Popen[str]]) -> None:
    http, proc = served
    schema = ref_chain(50)  # a chain well within the bounds compiles and constrains
    r = http.post("/v1/completions", json={**CMPL, "max_tokens": 8, "guided_json": schema})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith('"')
    _serves(http, proc)
