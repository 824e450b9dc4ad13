"""Issue 9: no request, client or tenant can take the worker down; admin is the operator's.

Each test is a defect that was found with a real client against a real server, replayed here.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
from server_live import API_KEY, LiveServer, start_server, unique_text, wait_idle

from prefixkv.engine import AsyncEngine
from prefixkv.server.errors import ERROR_CAUSE_HEADER
from prefixkv.server.limits import ServerLimits

ADMIN_KEY = "admin-key"
POISON = "POISONPILL"


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err  # type: ignore[no-any-return]


def _healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "still alive?", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.fixture()
def poisoned(engine: AsyncEngine) -> Iterator[None]:
    """Requests whose prompt contains POISON make the model raise (the engine's test hook)."""
    poison = engine.tokenizer.encode(POISON, add_special_tokens=False)

    def hook(phase: str, seqs: Sequence[Any]) -> None:
        for s in seqs:
            ids = s.token_ids
            if phase == "model" and any(ids[i:i + len(poison)] == poison
                                        for i in range(len(ids) - len(poison) + 1)):
                raise RuntimeError("injected model failure")

    engine.engine.fault_hook = hook
    yield
    engine.engine.fault_hook = None


# ---------------------------------------------------------------- defect 1: one request kills all


def test_a_top_p_that_rounds_to_zero_is_served(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_p": 5e-324})
    assert r.status_code == 200, r.text
    _healthy(http)


def test_a_failing_request_is_a_marked_500_and_the_others_complete(
    http: httpx.Client, server: LiveServer, poisoned: None
) -> None:
    results: dict[str, httpx.Response] = {}

    def send(name: str, prompt: str) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results[name] = c.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 6, "temperature": 0})

    threads = [threading.Thread(target=send, args=(f"ok{i}", unique_text(f"fine{i}", 30)))
               for i in range(3)]
    threads.append(threading.Thread(target=send, args=("bad", unique_text("x", 20) + POISON)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    err = _error(results["bad"], 500)
    assert err["code"] == "request_failed" and "injected model failure" in err["message"]
    assert results["bad"].headers[ERROR_CAUSE_HEADER] == "request"
    for i in range(3):
        body = results[f"ok{i}"].json()
        assert results[f"ok{i}"].status_code == 200 and body["usage"]["completion_tokens"] >= 1
    # streamed: an error event, then [DONE]; the stream itself was a 200
    with http.stream("POST", "/v1/completions", json={
            "prompt": POISON, "max_tokens": 4, "stream": True}) as r:
        if r.status_code == 200:
            events = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]" and "request_failed" in events[-2]
        else:  # failed before the first byte: a plain marked 500
            r.read()
            assert r.status_code == 500 and r.headers[ERROR_CAUSE_HEADER] == "request"
    _healthy(http)
    wait_idle(http)


# ---------------------------------------------------------------- defect 2: rejected but queued


def test_a_seed_overflow_is_a_400_that_leaves_nothing_running(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "n": 64, "seed": 2**64 - 2,
                                           "max_tokens": 2, "temperature": 1.0})
    assert _error(r, 400)["message"].startswith("seed ")
    stats = wait_idle(http, timeout=2)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


# ---------------------------------------------------------------- defect 3: request size


def test_a_body_over_the_limit_is_a_413(engine: AsyncEngine) -> None:
    live = start_server(engine, limits=ServerLimits(max_body_bytes=10_000))
    try:
        with httpx.Client(base_url=live.url, timeout=30) as c:
            big = {"prompt": "a" * 20_000, "max_tokens": 1}
            err = _error(c.post("/v1/completions", json=big), 413)
            assert err["code"] == "request_too_large" and "10000-byte" in err["message"]

            def chunks() -> Iterator[bytes]:  # no Content-Length: cut off while streaming
                yield b'{"prompt": "'
                for _ in range(30):
                    yield b"b" * 1000
                yield b'"}'

            _error(c.post("/v1/completions", content=chunks(),
                          headers={"content-type": "application/json"}), 413)
            assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200
    finally:
        live.stop()


def test_a_huge_prompt_is_refused_fast_and_health_stays_responsive(
    http: httpx.Client, server: LiveServer
) -> None:
    health: list[float] = []
    failures: list[BaseException | int] = []
    stop = threading.Event()

    def probe() -> None:  # at least one probe, even when the refusal beats the thread's start
        try:
            with httpx.Client(base_url=server.url, timeout=30) as c:
                while True:
                    t = time.perf_counter()
                    status = c.get("/health").status_code
                    if status != 200:
                        failures.append(status)
                    health.append(time.perf_counter() - t)
                    if stop.is_set():
                        return
                    time.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            failures.append(exc)

    # encoded before the clock starts: this process also hosts the server (one GIL)
    body = json.dumps({"prompt": "word " * 2_000_000, "max_tokens": 1}).encode()
    prober = threading.Thread(target=probe)
    prober.start()
    try:
        t0 = time.perf_counter()
        r = http.post("/v1/completions", content=body,
                      headers={"content-type": "application/json"})
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        prober.join()
    assert "holds a JSON string" in _error(r, 413)["message"]  # cut after ~1 MiB (string_guard)
    # was 20-50 s of tokenizing on a quiet machine; bounds generous for a loaded one
    assert elapsed < 8, elapsed
    assert not failures and health and max(health) < 4.0, (failures, health)


def test_n_and_batch_size_are_capped(http: httpx.Client) -> None:
    assert "--max-n" in _error(http.post("/v1/completions", json={
        "prompt": "x", "n": 65, "max_tokens": 1}), 400)["message"]
    err = _error(http.post("/v1/completions", json={"prompt": ["x"] * 257, "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and "257" in err["message"]


# ---------------------------------------------------------------- defect 4: admin is scoped


def test_admin_routes_refuse_clients_that_came_through_a_proxy(http: httpx.Client) -> None:
    proxied = {"X-Forwarded-For": "203.0.113.7"}
    for method, path in [("GET", "/v1/cache/pinned"), ("GET", "/v1/cache/stats"),
                         ("POST", "/v1/cache/reset"), ("POST", "/reset_prefix_cache")]:
        err = _error(http.request(method, path, headers=proxied), 403)
        assert err["code"] == "admin_only" and "--admin-api-key" in err["message"]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=proxied)
    assert r.status_code == 200  # inference is not admin


@pytest.fixture(scope="module")
def admin_server(engine: AsyncEngine) -> Iterator[LiveServer]:
    live = start_server(engine, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    yield live
    live.stop()


def test_with_an_admin_key_the_inference_key_cannot_manage_the_cache(
    admin_server: LiveServer,
) -> None:
    tenant = {"Authorization": f"Bearer {API_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=admin_server.url, timeout=60) as c:
        assert _error(c.get("/v1/cache/pinned", headers=tenant), 403)["code"] == "admin_only"
        _error(c.post("/v1/cache/reset", headers=tenant), 403)
        _error(c.post("/v1/cache/pin", headers=tenant, json={"text": "x" * 64}), 403)
        _error(c.get("/v1/cache/pinned"), 401)
        # the admin key manages the cache; it is not an inference key
        pin = c.post("/v1/cache/pin", headers=admin,
                     json={"text": unique_text("tenantsys", 30), "cache_salt": "t1"})
        assert pin.status_code == 200, pin.text
        listed = c.get("/v1/cache/pinned", headers=admin).json()["data"]
        assert any(p["cache_salt"] == "t1" for p in listed)
        assert c.post("/v1/cache/unpin", headers=admin, json={
            "text": unique_text("tenantsys", 30), "cache_salt": "t1"}).status_code == 200
        _error(c.post("/v1/completions", headers=admin, json={"prompt": "x"}), 401)
        assert c.post("/v1/completions", headers=tenant,
                      json={"prompt": "x", "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------- defect 8: chat default length


def test_chat_without_max_tokens_gets_the_default_cap(engine: AsyncEngine) -> None:
    live = start_server(engine, limits=ServerLimits(default_chat_max_tokens=3))
    try:
        with httpx.Client(base_url=live.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "tell me a long story"}],
                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] <= 3
    finally:
        live.stop()


# ---------------------------------------------------------------- defect 9: the smaller ones


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", '{"prompt": "\\ud800x", "max_tokens": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800x"}]}'),
])
def test_a_lone_surrogate_is_a_400(http: httpx.Client, path: str, body: str) -> None:
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert "not valid Unicode" in _error(r, 400)["message"]


def test_an_empty_body_says_what_is_missing(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert _error(r, 400)["message"] == "request body is required: a JSON object"


def test_the_openapi_schema_declares_the_errors_the_server_gives(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    op = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in op and {"400", "413", "500"} <= set(op)
    assert "HTTPValidationError" not in json.dumps(schema)
    for path in ("/v1/completions", "/v1/chat/completions"):  # `stream: true` answers events
        ok = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(ok)


def test_an_aborted_stream_counts_as_a_finished_request(http: httpx.Client) -> None:
    def aborts() -> float:
        text = http.get("/metrics").text
        m = re.search(r'prefixkv:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                      text) or re.search(r'request_success_total\{[^}]*abort[^}]*\} (\S+)', text)
        return float(m.group(1)) if m else 0.0

    before = aborts()
    with http.stream("POST", "/v1/completions", json={
            "prompt": unique_text("cut", 10), "max_tokens": 200, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 5
    while aborts() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts() == before + 1
    wait_idle(http)


def test_a_request_pins_leave_no_room_for_is_a_503(demo_model_engine_small: AsyncEngine) -> None:
    live = start_server(demo_model_engine_small)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as c:
            ids = list(range(40, 40 + 12 * 4))  # 12 of 16 blocks
            assert c.post("/v1/cache/pin", json={"token_ids": ids}).status_code == 200
            r = c.post("/v1/completions", json={"prompt": list(range(100, 130)), "max_tokens": 10})
            err = _error(r, 503)
            assert err["code"] == "insufficient_kv_capacity" and "pinned" in err["message"]
            assert ERROR_CAUSE_HEADER not in r.headers  # another worker may have room
    finally:
        live.stop()


@pytest.fixture(scope="module")
def demo_model_engine_small() -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_args(None, block_size=4, num_kv_blocks=16, max_pinned_blocks=12)
    yield eng
    eng.shutdown()
