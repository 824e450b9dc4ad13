"""``HEAD /health`` and ``HEAD /metrics`` on ``prefixkv route``: 200 without a body (were 405),
and the health status follows the workers as GET's does."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from prefixkv.router.app import RouterConfig, RouterServer


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "15")
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def worker() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_head_on_the_routers_health_and_metrics(worker: str) -> None:
    config = RouterConfig(worker_urls=(worker,), policy="round_robin", health_check_interval=0.2)
    with RouterServer(config) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        for path, kind in (("/health", "application/json"), ("/metrics", "text/plain")):
            head = http.head(path)
            assert head.status_code == http.get(path).status_code == 200, path
            assert head.content == b"" and head.headers["content-type"].startswith(kind)


def test_head_on_health_says_503_when_no_worker_is_healthy() -> None:
    config = RouterConfig(worker_urls=("http://127.0.0.1:9",), policy="round_robin",
                          health_check_interval=0.2, health_check_timeout=0.2)
    with RouterServer(config) as server:
        head = httpx.head(f"{server.url}/health", timeout=10)
        assert head.status_code == 503 and head.content == b""
