"""Helpers for the server tests: a live uvicorn server in a thread, polling, unique prompts."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from prefixkv.engine import AsyncEngine
from prefixkv.server.app import create_app

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 384  # 6,144 tokens: less than the demo's 8,192-token context
API_KEY = "test-key"
MODEL = "prefixkv-demo"


@dataclass
class LiveServer:
    """A running app: ``url`` is its base URL (no trailing slash)."""

    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_server(engine: AsyncEngine, **app_kwargs: object) -> LiveServer:
    """Serve ``create_app(engine, **app_kwargs)`` on a free loopback port until ``stop()``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(engine, **app_kwargs)  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    return LiveServer(f"http://127.0.0.1:{port}", engine, server, thread)


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict[str, Any]:
    """Poll the stats until no request runs and no block is locked; returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/v1/cache/stats").json()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and (stats["cache"] is None or stats["cache"]["locked_blocks"] == 0):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout}s: {stats}")
        time.sleep(0.02)


def unique_text(tag: str, n_words: int = 40) -> str:
    """A prompt no other test uses (so cache hits are this test's own)."""
    return " ".join(f"{tag}{i}" for i in range(n_words))


def wait_for_health(url: str, proc: subprocess.Popen[str], timeout: float = 90.0) -> None:
    """Poll ``url``/health until a ``prefixkv serve`` child answers 200; fails with its output
    if it exits, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)
