"""The event-loop lag histogram: a handler that holds the loop shows in its upper buckets, and
the live server exports it on ``/metrics`` from start."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest

from prefixkv.engine import AsyncEngine
from prefixkv.server.app import create_app
from prefixkv.server.loop_lag import LoopLag


def _count(registry: CollectorRegistry, le: str) -> float:
    value = registry.get_sample_value("prefixkv:event_loop_lag_seconds_bucket",
                                      {"model_name": "m", "le": le})
    assert value is not None
    return value


def test_a_callback_holding_the_loop_is_observed() -> None:
    registry = CollectorRegistry()
    lag = LoopLag(registry, "m", interval_s=0.005)

    async def main() -> None:
        async with lag.running():
            await asyncio.sleep(0.05)  # the timer runs freely first
            time.sleep(0.12)  # a handler that does not await: every other request waits
            await asyncio.sleep(0.05)

    asyncio.run(main())
    total = registry.get_sample_value("prefixkv:event_loop_lag_seconds_count", {"model_name": "m"})
    assert total is not None and total >= 5
    assert _count(registry, "+Inf") - _count(registry, "0.1") == 1  # the one stall, over 100 ms
    assert 0.1 < lag.worst_s < 1.0
    assert b"prefixkv:event_loop_lag_seconds_bucket" in generate_latest(registry)


def test_the_task_stops_with_the_app() -> None:
    lag = LoopLag(CollectorRegistry(), "m", interval_s=0.001)

    async def main() -> set[asyncio.Task[object]]:
        async with lag.running():
            await asyncio.sleep(0.01)
        return {t for t in asyncio.all_tasks() if t.get_name() == "prefixkv-loop-lag"}

    assert asyncio.run(main()) == set()


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LoopLag(CollectorRegistry(), "m", interval_s=0)


def test_the_server_exports_it(engine: AsyncEngine) -> None:
    """Through uvicorn with its lifespan on, as ``prefixkv serve`` runs the app."""
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def count() -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        line = next(x for x in text.splitlines()
                    if x.startswith("prefixkv:event_loop_lag_seconds_count"))
        return float(line.rsplit(" ", 1)[1])

    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        first = count()
        time.sleep(0.3)
        assert count() > first  # the timer keeps running in the serving loop
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()  # the lifespan's exit stopped the task; uvicorn returned
