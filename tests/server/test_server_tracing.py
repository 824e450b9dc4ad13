"""``prefixkv serve --otlp-traces-endpoint``: a real server exports one ``llm_request`` span per
request to a loopback OTLP/HTTP receiver (OTLP's JSON encoding decoded here), with the usage the
responses report, the cached tokens by tier, the tenant hashed and a ``traceparent`` kept; without
the packages the flag is one clear error at start; without the flag prefixkv imports neither the
SDK's tracing nor the exporter (FastAPI imports OpenTelemetry's API itself, and redis-py the SDK's
metrics when the SDK is installed)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_live import wait_for_health
from test_server_cli import _free_port
from test_server_tiers import text

from prefixkv.cli import build_parser
from prefixkv.router.app import RouterConfig, RouterServer
from prefixkv.server.limits import ServerLimits

ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SALT = "tenant-secret-salt"


@dataclass
class Span:
    """One span of an OTLP/JSON export, its ids as bytes (hex on the wire)."""

    name: str
    kind: int
    attributes: list[dict[str, Any]]
    trace_id: bytes
    parent_span_id: bytes
    start_time_unix_nano: int
    end_time_unix_nano: int
    SPAN_KIND_SERVER = 2  # OTLP's enum


class OtlpReceiver:
    """A loopback OTLP/HTTP trace receiver: ``POST /v1/traces`` bodies in OTLP's JSON encoding
    (what prefixkv sends); ``spans`` holds ``(resource attributes, span)`` pairs."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Span]] = []
        self.bad_paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/json":
                    receiver.bad_paths.append(f"{self.path} {self.headers.get('Content-Type')}")
                    self.send_response(404)
                    self.end_headers()
                    return
                for rs in json.loads(body)["resourceSpans"]:
                    resource = _attributes(rs["resource"]["attributes"])
                    receiver.spans += [(resource, Span(
                        s["name"], s["kind"], s["attributes"], bytes.fromhex(s["traceId"]),
                        bytes.fromhex(s.get("parentSpanId", "")), int(s["startTimeUnixNano"]),
                        int(s["endTimeUnixNano"]))) for ss in rs["scopeSpans"] for s in ss["spans"]]
                answer = b"{}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attributes(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """OTLP/JSON ``KeyValue`` s as a dict of plain values (64-bit ints come as strings)."""
    out: dict[str, Any] = {}
    for kv in pairs:
        (kind, value), = kv["value"].items()
        out[kv["key"]] = int(value) if kind == "intValue" else value
    return out


@pytest.fixture()
def receiver() -> Iterator[OtlpReceiver]:
    pytest.importorskip("opentelemetry.sdk")
    r = OtlpReceiver()
    yield r
    r.stop()


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_serve_exports_one_span_per_request_with_usage_cache_tiers_and_parent(
        receiver: OtlpReceiver) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "serve", "--port", str(port), "--num-kv-blocks",
         "48", "--kv-offload-size", "4MiB", "--log-level", "warning",
         "--otlp-traces-endpoint", receiver.url],
        cwd=ROOT, env=_clean_env(OTEL_SERVICE_NAME="prefixkv-trace-test"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(url, proc)
        prefix = text(1, 600)  # byte-level demo tokenizer: 600 tokens, 37 full blocks
        body = {"model": "prefixkv-demo", "max_tokens": 4, "temperature": 0, "cache_salt": SALT}
        first = httpx.post(url + "/v1/completions", json={**body, "prompt": prefix + " one"},
                           timeout=60).json()
        other = httpx.post(url + "/v1/completions", json={**body, "prompt": text(2, 600)},
                           timeout=60).json()  # the pool holds one: most of prefix's go to host
        lines: list[dict[str, Any]] = []
        router = RouterServer(RouterConfig(worker_urls=(url,), eviction_interval=0))
        with router, httpx.stream("POST", router.url + "/v1/completions", timeout=60,
                          headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                          json={**body, "prompt": prefix + " two", "stream": True,
                                "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    lines.append(json.loads(line[len("data: "):]))
        second = {"id": lines[0]["id"], "usage": lines[-1]["usage"]}
        sglang = httpx.post(url + "/generate", timeout=60, json={
            "text": prefix + " three", "cache_salt": SALT,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()["meta_info"]
        proc.send_signal(signal.SIGTERM)  # the app's shutdown flushes the queued spans
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read() if proc.stdout else ""
    assert receiver.bad_paths == [], out
    spans = {_attributes(s.attributes)["gen_ai.request.id"]: (resource, s)
             for resource, s in receiver.spans}
    assert len(receiver.spans) == 4, out
    assert set(spans) == {first["id"], other["id"], second["id"], sglang["id"]}, out
    tenant = hashlib.sha256(SALT.encode()).hexdigest()[:12]
    for answer in (first, other, second):
        resource, span = spans[answer["id"]]
        attrs = _attributes(span.attributes)
        usage = answer["usage"]
        assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
        assert resource["service.name"] == "prefixkv-trace-test"
        assert attrs["gen_ai.response.model"] == "prefixkv-demo"
        assert attrs["gen_ai.request.max_tokens"] == 4
        assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
        assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 4
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert attrs["prefixkv.cached_tokens"] == cached
        lower = attrs["prefixkv.cached_tokens.lower_tiers"]
        assert attrs["prefixkv.cached_tokens.pool"] + lower == cached
        assert sum(attrs[f"prefixkv.cached_tokens.{t}"] for t in ("host", "disk", "remote")) == lower
        assert attrs["prefixkv.cached_tokens.disk"] == attrs["prefixkv.cached_tokens.remote"] == 0
        assert attrs["prefixkv.computed_tokens"] == usage["prompt_tokens"] - cached
        assert attrs["prefixkv.tenant"] == tenant
        assert SALT not in repr(attrs) and "prefixkv.lora" not in attrs
        assert attrs["gen_ai.latency.e2e"] >= attrs["gen_ai.latency.time_to_first_token"] > 0
        assert span.end_time_unix_nano >= span.start_time_unix_nano > 0
    first_span, second_span = spans[first["id"]][1], spans[second["id"]][1]
    assert _attributes(first_span.attributes)["prefixkv.cached_tokens"] == 0
    reused = _attributes(second_span.attributes)
    assert reused["prefixkv.cached_tokens.host"] > 0 and reused["prefixkv.cached_tokens.pool"] > 0
    assert reused["prefixkv.lower_tiers.queried_tokens"] >= reused["prefixkv.cached_tokens.host"]
    # through the router: it passes the caller's trace context on to the worker
    assert second_span.trace_id.hex() == TRACE_ID and second_span.parent_span_id.hex() == PARENT_ID
    assert first_span.parent_span_id == b"" and first_span.trace_id.hex() != TRACE_ID
    generated = _attributes(spans[sglang["id"]][1].attributes)  # SGLang's /generate too
    assert generated["gen_ai.usage.prompt_tokens"] == sglang["prompt_tokens"]
    assert generated["gen_ai.usage.completion_tokens"] == sglang["completion_tokens"] == 3
    assert generated["prefixkv.cached_tokens"] == sglang["cached_tokens"] > 0
    assert generated["prefixkv.tenant"] == tenant and generated["gen_ai.latency.time_to_first_token"] > 0


def test_a_collector_that_is_down_fails_no_request() -> None:
    pytest.importorskip("opentelemetry.sdk")
    port, dead = _free_port(), _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "serve", "--port", str(port), "--num-kv-blocks",
         "64", "--log-level", "warning",
         "--otlp-traces-endpoint", f"http://127.0.0.1:{dead}/v1/traces"],
        cwd=ROOT, env=_clean_env(OTEL_BSP_SCHEDULE_DELAY="50"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(url, proc)
        for i in range(3):
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "prefixkv-demo", "prompt": f"down {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read() if proc.stdout else ""
    assert "prefixkv: engine stopped" in out, out


def test_the_flag_without_the_packages_fails_at_start_naming_the_extra() -> None:
    blocked = ("import sys; sys.modules['opentelemetry.sdk'] = None; from prefixkv.cli import main; "
               "sys.exit(main(['serve', '--port', '9', '--otlp-traces-endpoint', "
               "'http://127.0.0.1:9/v1/traces']))")
    run = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, env=_clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert 'pip install "prefixkv[tracing]"' in run.stderr and "serving" not in run.stdout


def test_without_the_flag_neither_the_tracing_sdk_nor_the_exporter_is_imported() -> None:
    probe = ("import sys; from fastapi import FastAPI; from prefixkv.cli import build_parser; "
             "import prefixkv.server.app, prefixkv.cli.serve; "
             "from prefixkv.server.tracing import install_tracing; "
             "args = build_parser().parse_args(['serve']); assert args.otlp_traces_endpoint is None; "
             "assert install_tracing(FastAPI(), args.otlp_traces_endpoint) is None; "
             "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', "
             "'opentelemetry.exporter', 'opentelemetry.proto', 'prefixkv.server.otlp_json'))))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=_clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def test_the_endpoint_comes_from_the_sdk_variable_and_must_be_otlp_http(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    args = build_parser().parse_args(["serve"])
    assert args.otlp_traces_endpoint == "http://collector:4318/v1/traces"
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        ServerLimits(otlp_traces_endpoint="collector:4317")
    pytest.importorskip("opentelemetry.sdk")
    from prefixkv.server.tracing import check_installed

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with pytest.raises(RuntimeError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        check_installed()
