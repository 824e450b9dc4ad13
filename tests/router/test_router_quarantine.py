"""A request that kills the worker serving it (a query of death), through the real router over
three real worker processes: it costs at most one worker when it is alone on it (never more
than two), is quarantined by body fingerprint, and the fleet goes on serving.

The workers are real ``prefixkv`` servers (this file run as a script: the demo engine behind the
real app and uvicorn) with one test hook: the engine's fault hook calls ``os.abort()`` (a native
crash, SIGABRT, like a segfault in a native library) when a sequence's prompt starts with
:data:`CRASH_PREFIX`. Nothing in the package knows about it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from prefixkv.router.app import WORKER_HEADER, RouterConfig, RouterServer
from prefixkv.bench.route.run import ready
from prefixkv.router.local import LocalWorkers, free_port
from prefixkv.router.quarantine import Quarantine, fingerprint

CRASH_PREFIX = [3, 1, 4]
POISON = {"prompt": [*CRASH_PREFIX, 1, 5, 9, 2, 6], "max_tokens": 2}
LATE_PREFIX = [2, 7, 1]  # crashes after its 4th generated token (mid-stream)
LATE_POISON = {"prompt": [*LATE_PREFIX, 8, 2, 8, 1, 8], "max_tokens": 64, "ignore_eos": True,
               "stream": True}


def _serve_crashing_worker(port: int) -> None:  # runs in the worker process
    import resource

    import uvicorn

    from prefixkv.engine import AsyncEngine
    from prefixkv.server.app import create_app

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the abort leaves no core file
    engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=128)

    def hook(phase: str, seqs: object) -> None:
        for s in seqs:  # type: ignore[attr-defined]
            if s.token_ids[:3] == CRASH_PREFIX or (s.token_ids[:3] == LATE_PREFIX
                                                   and len(s.token_ids) >= 8 + 4):
                os.abort()

    engine.engine.fault_hook = hook
    uvicorn.run(create_app(engine), host="127.0.0.1", port=port, log_level="warning")


class CrashingWorkers(LocalWorkers):
    """Three of this file's worker processes on free loopback ports; :meth:`revive` restarts
    the dead ones."""

    def __init__(self, n: int = 3) -> None:
        super().__init__(n, command=[sys.executable, __file__])
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 180.0) -> None:
        asyncio.run(ready(self.urls, timeout=timeout))

    def dead(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() is not None]

    def revive(self) -> None:
        for i in self.dead():
            self.restart(i)
        self.wait_healthy()


@pytest.fixture(scope="module")
def workers() -> Iterator[CrashingWorkers]:
    fleet = CrashingWorkers(3)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def router(workers: CrashingWorkers) -> Iterator[RouterServer]:
    workers.revive()
    config = RouterConfig(worker_urls=tuple(workers.urls), policy="round_robin",
                          health_check_interval=0.5, health_check_timeout=2.0)
    with RouterServer(config) as server:
        yield server


def complete(server: RouterServer, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def metric(server: RouterServer, prefix: str) -> float:
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    return sum(float(ln.split()[-1]) for ln in lines if ln.startswith(prefix))


def test_a_request_that_kills_its_worker_costs_one_worker_and_is_quarantined(
    workers: CrashingWorkers, router: RouterServer
) -> None:
    """Issue 40 item 2: the old router walked the request through the fleet, 3 of 3 dead."""
    for i in range(3):  # every worker has a pooled keep-alive connection: the poison reuses one
        assert complete(router, {"prompt": f"warm {i}", "max_tokens": 2}).status_code == 200
    r = complete(router, POISON)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "request_quarantined"
    assert "died while serving this request" in r.json()["error"]["message"]
    assert r.headers["x-prefixkv-error-cause"] == "request"
    time.sleep(0.5)
    assert len(workers.dead()) == 1, f"dead workers: {workers.dead()}"
    dead_url = workers.urls[workers.dead()[0]]
    assert not router.router.workers[dead_url].healthy

    served = [complete(router, {"prompt": f"after {i}", "max_tokens": 2}) for i in range(4)]
    assert [a.status_code for a in served] == [200] * 4
    assert {a.headers[WORKER_HEADER] for a in served} == set(workers.urls) - {dead_url}

    t0 = time.monotonic()
    again = complete(router, POISON)  # the client's resend: refused without reaching a worker
    assert time.monotonic() - t0 < 1.0
    assert again.status_code == 503 and again.json()["error"]["code"] == "request_quarantined"
    assert len(workers.dead()) == 1
    assert metric(router, "prefixkv:router_quarantined_requests_total") == 2
    assert metric(router, "prefixkv:router_request_caused_deaths_total") == 1
    assert complete(router, {"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_a_killer_among_other_requests_costs_at_most_two_workers(
    workers: CrashingWorkers, router: RouterServer
) -> None:
    """A worker that dies with several requests in flight cannot tell which one killed it:
    each is retried once with a strike on its body, so the others are served elsewhere; the
    killer's second death is pinned on it."""
    bodies = [{"prompt": f"[{i}] a longer story " * 8, "max_tokens": 48, "temperature": 0.0}
              for i in range(6)]
    state = router.router.workers
    with ThreadPoolExecutor(7) as pool:
        others = [pool.submit(complete, router, b) for b in bodies]
        deadline = time.monotonic() + 60
        while not all(state[u].in_flight > 0 for u in workers.urls):
            assert time.monotonic() < deadline, "the load never reached every worker"
            time.sleep(0.01)
        poison = pool.submit(complete, router, POISON).result()
        answers = [f.result() for f in others]
    assert poison.status_code == 502 and poison.json()["error"]["code"] == "request_quarantined"
    assert [a.status_code for a in answers] == [200] * len(answers)
    time.sleep(0.5)
    assert 1 <= len(workers.dead()) <= 2, f"dead workers: {workers.dead()}"
    print(f"poison among {len(bodies)} requests: {len(workers.dead())} worker(s) lost, "
          f"{len(answers)} others served")
    assert complete(router, {"prompt": "after the storm", "max_tokens": 2}).status_code == 200
    assert complete(router, POISON).status_code == 503


def test_a_stream_that_kills_its_worker_ends_with_an_error_and_is_quarantined(
    workers: CrashingWorkers, router: RouterServer
) -> None:
    """A stream is never retried once its answer started; its death is judged all the same, so
    the client's resend does not take a second worker."""
    body = LATE_POISON
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
        status = r.status_code
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    print(f"stream poison: status {status}, last event {events[-1] if events else None}")
    time.sleep(0.5)
    assert len(workers.dead()) == 1, f"dead workers: {workers.dead()}"
    assert status == 200 and len(events) >= 2  # tokens reached the client, then the cut
    assert "worker_failed" in events[-1] and "quarantined" in events[-1], events
    again = complete(router, body)
    assert again.status_code == 503 and again.json()["error"]["code"] == "request_quarantined"
    assert len(workers.dead()) == 1
    assert complete(router, {"prompt": "served", "max_tokens": 2}).status_code == 200


def test_bad_requests_never_open_a_breaker(workers: CrashingWorkers,
                                           router: RouterServer) -> None:
    """Ten 400s in a row (more than --failure-threshold) leave every worker in rotation."""
    for i in range(10):
        r = complete(router, {"prompt": f"bad {i}", "max_tokens": -1})
        assert r.status_code == 400
    assert all(w.healthy and w.consecutive_failures == 0 and w.failures == 0
               for w in router.router.workers.all())
    served = [complete(router, {"prompt": f"good {i}", "max_tokens": 2}) for i in range(3)]
    assert [a.status_code for a in served] == [200] * 3
    assert {a.headers[WORKER_HEADER] for a in served} == set(workers.urls)
    assert metric(router, "prefixkv:router_quarantined_requests_total") == 0


def test_quarantine_strikes_condemns_expires_and_stays_bounded() -> None:
    now = [0.0]
    q = Quarantine(10.0, 3, clock=lambda: now[0])
    a, b = fingerprint("POST", "/v1/completions", b"{}"), fingerprint("POST", "/v1/chat", b"{}")
    assert a != b and a == fingerprint("post", "/v1/completions", b"{}")
    q.suspect(a)
    assert q.has_strike(a) and q.refused_for(a) is None  # a strike alone refuses nothing
    q.condemn(a)
    now[0] = 4.0
    assert q.refused_for(a) == pytest.approx(6.0)
    q.suspect(a)  # a condemned body stays condemned
    assert q.refused_for(a) is not None
    now[0] = 10.0
    assert q.refused_for(a) is None and not q.has_strike(a) and len(q) == 0
    for i in range(5):
        q.condemn(fingerprint("POST", "/p", bytes([i])))
    assert len(q) == 3 and q.refused_for(fingerprint("POST", "/p", b"\x00")) is None
    with pytest.raises(ValueError, match="ttl"):
        Quarantine(0, 3)
    with pytest.raises(ValueError, match="quarantine_size"):
        RouterConfig(worker_urls=("http://127.0.0.1:1",), quarantine_size=0)


def test_peers_learn_strikes_and_quarantines_without_passing_them_on() -> None:
    now = [0.0]
    told: list[tuple[str, float, bool]] = []
    q = Quarantine(10.0, 8, clock=lambda: now[0])
    q.listener = lambda fp, seconds, condemned: told.append((fp, seconds, condemned))
    q.suspect("s")
    q.condemn("c")
    assert told == [("s", 10.0, False), ("c", 10.0, True)]  # decided here: told to the peers
    q.learn("p", 60.0, True)  # from a peer: capped at this router's ttl, not told again
    assert q.refused_for("p") == pytest.approx(10.0) and len(told) == 2
    q.learn("c", 2.0, False)  # a peer's strike never lifts a quarantine
    q.learn("c", 1.0, True)  # nor does a shorter quarantine shorten it
    assert q.refused_for("c") == pytest.approx(10.0)
    q.learn("s", 4.0, True)  # a peer's quarantine of a body struck here condemns it
    assert q.refused_for("s") == pytest.approx(4.0)
    q.learn("x", 0.0, True)
    assert not q.has_strike("x")


def test_a_request_that_killed_a_worker_through_one_replica_is_refused_by_the_other(
    workers: CrashingWorkers,
) -> None:
    """Router replicas (``--peer-urls``) share their quarantine: without it, a query of death
    costs one worker per replica it reaches."""
    workers.revive()
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    configs = [RouterConfig(worker_urls=tuple(workers.urls), policy="round_robin",
                            health_check_interval=0.5, health_check_timeout=2.0,
                            peer_urls=(urls[1 - i],)) for i in range(2)]
    with RouterServer(configs[0], port=ports[0]) as a, RouterServer(configs[1], port=ports[1]) as b:
        for i in range(3):
            assert complete(a, {"prompt": f"warm {i}", "max_tokens": 2}).status_code == 200
        first = complete(a, POISON)
        assert first.status_code == 502 and first.json()["error"]["code"] == "request_quarantined"
        deadline = time.monotonic() + 5.0  # the sync posts every 10 ms; a loaded machine is slower
        while b.router.quarantine.refused_for(fingerprint("POST", "/v1/completions",
                                                          first.request.content)) is None:
            assert time.monotonic() < deadline, "replica b never learned the quarantine"
            time.sleep(0.05)
        again = complete(b, POISON)
        assert again.status_code == 503 and again.json()["error"]["code"] == "request_quarantined"
        time.sleep(0.5)
        assert len(workers.dead()) == 1, f"dead workers: {workers.dead()}"
        assert complete(b, {"prompt": "still fine", "max_tokens": 2}).status_code == 200


if __name__ == "__main__":  # as LocalWorkers starts it: --host H --port P
    _serve_crashing_worker(int(sys.argv[sys.argv.index("--port") + 1]))
