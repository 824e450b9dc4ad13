"""Failure handling against small scripted HTTP workers (stdlib servers on loopback): which
answers pass through untouched, which are retried, and the circuit breaker; and ``prefixkv route
--launch`` leaving no worker behind on SIGTERM or SIGHUP (real prefixkv workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from prefixkv.router.app import WORKER_HEADER, RouterConfig, RouterServer
from prefixkv.router.local import free_port


class Scripted(ThreadingHTTPServer):
    """A worker whose POST answers follow ``script`` (then ``ok``); ``/health`` is always 200.

    ``ok`` 200 JSON; ``bad`` 400; ``req500`` 500 blamed on the request; ``req503`` 503 blamed on
    the request (a worker whose ``/health`` says it is fine); ``500`` a plain 500;
    ``drop`` closes the connection without answering.
    """

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script: list[str] = []
        self.posts = 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Scripted

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        srv = self.server
        srv.posts += 1
        step = srv.script.pop(0) if srv.script else "ok"
        err = {"error": {"message": step, "type": "x", "param": None, "code": None}}
        if step == "drop":
            self.close_connection = True
            self.connection.shutdown(2)
        elif step == "bad":
            self._send(400, err)
        elif step in ("req500", "req503"):
            self._send(int(step[3:]), err, {"X-Prefixkv-Error-Cause": "request"})
        elif step == "500":
            self._send(500, err)
        else:
            self._send(200, {"choices": [{"text": "fine"}]})


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Scripted, Scripted, RouterServer]]:
    a, b = Scripted(), Scripted()
    interval = getattr(request, "param", 1.0)  # seconds between health probes
    config = RouterConfig(worker_urls=(a.url, b.url), policy="round_robin",
                          health_check_interval=interval, health_check_timeout=1.0)
    with RouterServer(config) as server:
        yield a, b, server
    a.shutdown()
    b.shutdown()


def post(server: RouterServer) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, timeout=30)


def test_request_caused_errors_pass_through_once_and_do_not_count(pair) -> None:
    """Issue 40 item 3: request-caused errors, many more than --failure-threshold of them (4
    request-caused 503s used to open every breaker), never count against a worker."""
    a, b, server = pair
    for step, status in [("bad", 400), ("req500", 500), ("req503", 503)] * 4:
        a.script, b.script = [step], [step]
        before = a.posts + b.posts
        r = post(server)
        assert r.status_code == status and r.json()["error"]["message"] == step
        assert a.posts + b.posts == before + 1  # never retried
        if step != "bad":
            assert r.headers["x-prefixkv-error-cause"] == "request"
    states = httpx.get(f"{server.url}/workers").json()["workers"]
    assert all(w["failures"] == 0 and w["breaker"] == "closed" for w in states)


def test_worker_caused_5xx_is_retried_on_another_worker(pair) -> None:
    a, b, server = pair
    a.script, b.script = ["500"], ["500"]
    r = post(server)  # round robin: a first, then b; both failed: the last 5xx goes back
    assert r.status_code == 500 and a.posts == 1 and b.posts == 1
    r = post(server)
    assert r.status_code == 200


def test_one_dropped_connection_fails_over_and_keeps_the_worker(pair) -> None:
    a, b, server = pair
    a.script = ["drop"]
    answers = [post(server) for _ in range(20)]
    assert [r.status_code for r in answers] == [200] * 20
    by = {u: sum(r.headers[WORKER_HEADER] == u for r in answers) for u in (a.url, b.url)}
    assert by[a.url] >= 9  # still in rotation: no burst of failures, no ejection
    state = server.router.workers[a.url]
    assert state.healthy and state.failures == 1 and state.consecutive_failures == 0


# probes 4 s apart: the six posts finish before a probe can half-open the breaker, even on a
# loaded machine
@pytest.mark.parametrize("pair", [4.0], indirect=True)
def test_repeated_failures_open_the_breaker_and_a_probe_closes_it(pair) -> None:
    a, _b, server = pair
    a.script = ["500"] * 3
    for _ in range(6):
        assert post(server).status_code == 200
    assert a.posts == 3 and server.router.workers[a.url].state == "open"
    deadline = time.monotonic() + 20
    while server.router.workers[a.url].state == "open":  # /health answers: half open
        assert time.monotonic() < deadline
        time.sleep(0.05)
    answers = [post(server) for _ in range(4)]
    assert a.url in {r.headers[WORKER_HEADER] for r in answers}
    assert server.router.workers[a.url].state == "closed"


def test_a_dead_worker_leaves_at_once_through_the_immediate_probe(pair) -> None:
    a, _b, server = pair
    a.shutdown()
    a.server_close()  # new connections are refused, the open one drops: a dead process
    a.script = ["drop"] * 10
    answers = [post(server) for _ in range(6)]
    assert [r.status_code for r in answers] == [200] * 6
    assert a.posts <= 1 and not server.router.workers[a.url].healthy


def _worker_children(pid: int) -> list[int]:
    """The ``prefixkv serve`` children of ``pid``; other children (the router's imports run a
    short-lived ``ldconfig -p`` while it starts) are not workers and would read as dead ones."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if int(fields[1]) == pid and b"serve" in argv:
                kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_launch_stops_its_workers_on_sigterm_and_sighup(sig: signal.Signals) -> None:
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "prefixkv.cli", "route", "--launch", "1", "--port", str(port),
         "--worker-args", "--num-kv-blocks 64 --log-level warning", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert router.poll() is None and time.monotonic() < deadline, "router did not start"
            workers = workers or _worker_children(router.pid)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert workers and all(_alive(p) for p in workers)
        router.send_signal(sig)
        router.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in workers):
            assert time.monotonic() < deadline, f"orphaned workers after {sig.name}"
            time.sleep(0.1)
    finally:
        if router.poll() is None:
            router.kill()
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_request_that_breaks_real_workers_is_tried_on_one_worker_only() -> None:
    """Issue 9 defect 1 end to end: a request that makes the engine raise (injected through
    the engine's fault hook) is answered 500 request-caused by one real worker, not walked
    through the fleet; both workers keep serving."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))
    from server_live import start_server

    from prefixkv.engine import AsyncEngine

    engines = [AsyncEngine.from_args(None, block_size=16, num_kv_blocks=64) for _ in range(2)]
    tried: list[int] = []

    def hook_for(i: int):  # type: ignore[no-untyped-def]
        def hook(phase: str, seqs: object) -> None:
            if phase == "model" and any(7 in s.token_ids for s in seqs):  # type: ignore[attr-defined]
                tried.append(i)
                raise RuntimeError("poisoned")
        return hook

    lives = []
    try:
        for i, eng in enumerate(engines):
            eng.engine.fault_hook = hook_for(i)
            lives.append(start_server(eng))
        config = RouterConfig(worker_urls=tuple(w.url for w in lives), policy="round_robin",
                              health_check_interval=1.0, health_check_timeout=2.0)
        with RouterServer(config) as server:
            r = httpx.post(f"{server.url}/v1/completions",
                           json={"prompt": [5, 6, 7, 8], "max_tokens": 2}, timeout=60)
            assert r.status_code == 500 and r.headers["x-prefixkv-error-cause"] == "request"
            assert r.json()["error"]["code"] == "request_failed"
            assert len(set(tried)) == 1  # one worker saw it: no retry elsewhere
            for _ in range(2):
                ok = httpx.post(f"{server.url}/v1/completions",
                                json={"prompt": [5, 6, 9], "max_tokens": 2}, timeout=60)
                assert ok.status_code == 200, ok.text
            assert all(e.is_running for e in engines)
    finally:
        for live in lives:
            live.stop()
        for eng in engines:
            eng.shutdown()


def test_cache_admin_through_the_router_fans_out_to_every_worker() -> None:
    """Issue 10: the router forwards /v1/cache/* to all workers (or one with ?worker=), under
    the same admin rule as a worker: the fleet's admin key, passed on."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))
    from server_live import start_server

    from prefixkv.engine import AsyncEngine

    key = "fleet-admin"
    engines = [AsyncEngine.from_args(None, block_size=4, num_kv_blocks=64) for _ in range(2)]
    lives = [start_server(e, admin_api_key=key) for e in engines]
    try:
        config = RouterConfig(worker_urls=tuple(w.url for w in lives), policy="round_robin",
                              health_check_interval=1.0, admin_api_key=key)
        admin = {"Authorization": f"Bearer {key}"}
        with RouterServer(config) as server:
            base = server.url
            assert httpx.get(f"{base}/v1/cache/stats", timeout=30).status_code == 403
            r = httpx.get(f"{base}/v1/cache/stats", headers=admin, timeout=30)
            assert r.status_code == 200
            assert sorted(d["worker"] for d in r.json()["data"]) == sorted(w.url for w in lives)
            assert all(d["body"]["num_kv_blocks"] == 64 for d in r.json()["data"])
            pin = httpx.post(f"{base}/v1/cache/pin", headers=admin, timeout=60,
                             json={"token_ids": list(range(40, 60))})
            assert pin.status_code == 200 and all(d["body"]["pinned"] for d in pin.json()["data"])
            one = httpx.get(f"{base}/v1/cache/pinned", params={"worker": lives[0].url},
                            headers=admin, timeout=30).json()["data"]
            assert len(one) == 1 and one[0]["body"]["data"][0]["num_blocks"] == 5
            bad = httpx.post(f"{base}/v1/cache/pin", headers=admin, timeout=30,
                             json={"token_ids": [1]})  # shorter than a block: every worker 400
            assert bad.status_code == 400
            reset = httpx.post(f"{base}/v1/cache/reset", headers=admin, timeout=30)
            assert reset.status_code == 200
            assert all(d["body"]["reset"] for d in reset.json()["data"])
    finally:
        for live in lives:
            live.stop()
        for eng in engines:
            eng.shutdown()
