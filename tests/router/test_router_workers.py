"""Worker URLs, the registry's counters and health, and probes of a dead address."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from prefixkv.router.health import probe, wait_until_healthy
from prefixkv.router.local import free_port
from prefixkv.router.workers import WorkerRegistry, normalize_worker_url


def test_normalize_worker_url() -> None:
    assert normalize_worker_url(" http://127.0.0.1:8000/ ") == "http://127.0.0.1:8000"
    assert normalize_worker_url("https://host/prefix") == "https://host/prefix"
    for bad in ("127.0.0.1:8000", "ftp://host", "http://", "http://h:notaport", "http://h?x=1"):
        with pytest.raises(ValueError, match="bad worker URL"):
            normalize_worker_url(bad)


def test_registry_counts_and_rotation() -> None:
    reg = WorkerRegistry(["http://a:1", "http://b:2/"])
    assert reg.urls == ["http://a:1", "http://b:2"]
    reg.begin("http://a:1")
    assert reg.loads() == {"http://a:1": 1, "http://b:2": 0}
    reg.end("http://a:1")
    assert reg["http://a:1"].routed == 1 and reg["http://a:1"].in_flight == 0
    assert reg.mark_down("http://b:2", "boom") is True
    assert reg.mark_down("http://b:2", "boom") is False
    assert reg.healthy() == ["http://a:1"] and reg["http://b:2"].failures == 2
    assert reg.healthy(exclude=["http://a:1"]) == []
    assert reg.mark_up("http://b:2") is True and reg.healthy() == reg.urls
    assert reg["http://b:2"].state == "half_open" and reg.mark_up("http://b:2") is False
    with pytest.raises(ValueError, match="duplicates"):
        WorkerRegistry(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="at least one"):
        WorkerRegistry([])


def test_probe_and_wait_report_a_dead_worker() -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def run() -> tuple[str | None, str]:
        async with httpx.AsyncClient() as client:
            error = await probe(client, dead, 1.0)
            with pytest.raises(RuntimeError) as info:
                await wait_until_healthy(client, [dead], timeout=0.3, poll=0.1)
            return error, str(info.value)

    error, message = asyncio.run(run())
    assert error is not None and "Connect" in error
    assert dead in message and "not healthy" in message


def test_breaker_opens_after_threshold_failures_in_a_row_and_half_opens_on_a_probe() -> None:
    reg = WorkerRegistry(["http://a:1"], failure_threshold=3)
    url = "http://a:1"
    assert reg.record_failure(url, "reset") is False  # one dropped connection: still in
    assert reg.record_failure(url, "reset") is False
    reg.record_success(url)  # the count restarts
    assert reg.record_failure(url, "reset") is False and reg.record_failure(url, "x") is False
    assert reg.record_failure(url, "refused") is True  # third in a row: open
    assert reg[url].state == "open" and reg.healthy() == [] and reg[url].failures == 5
    assert reg.record_failure(url, "again") is False  # already open
    assert reg.mark_up(url) is True and reg[url].state == "half_open"
    assert reg.record_failure(url, "still bad") is True  # half open: one failure reopens
    assert reg.mark_up(url) is True
    reg.record_success(url)
    assert reg[url].state == "closed" and reg[url].consecutive_failures == 0
    with pytest.raises(ValueError, match="failure_threshold"):
        WorkerRegistry([url], failure_threshold=0)


def test_a_probe_sent_before_a_failure_does_not_bring_the_worker_back() -> None:
    """A worker dies while a health probe it answered is still being read: its requests fail,
    the breaker opens, and the late answer (sent before the failure) must not re-admit it; a
    probe sent afterwards that answers does."""
    now = [10.0]
    reg = WorkerRegistry(["http://a:1"], failure_threshold=1, clock=lambda: now[0])
    url = "http://a:1"
    sent = reg.clock()  # the health loop sends its probe ...
    now[0] = 11.0
    assert reg.record_failure(url, "connection reset") is True  # ... the worker dies
    assert reg[url].last_failure_at == 11.0
    assert reg.mark_up(url, sent) is False and reg[url].state == "open" and reg.healthy() == []
    now[0] = 12.0
    assert reg.mark_down(url, "refused") is False and reg.mark_up(url, 11.5) is False
    assert reg.mark_up(url, 12.0) is True and reg[url].state == "half_open"
