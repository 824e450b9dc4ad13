"""Owns: ``GET /kv_events`` (where this worker publishes its KV events).
Imports: prefixkv.engine and errors.py; no dialect.

``GET /kv_events``: where this worker publishes its KV events (router discovery).

Answers ``{"endpoint", "replay_endpoint", "topic", "block_size"}``: the addresses actually bound
(a ``tcp://127.0.0.1:*`` endpoint resolved to its port), so a router started with
``--policy precise`` and no ``--kv-events`` list finds every worker's event stream by itself,
also after a worker restarted on another port. A worker that publishes nothing answers 404.
An address bound on every interface (``0.0.0.0``, ``::``) is for the caller to reach through the
host it used for this request.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.server.errors import APIError

__all__ = ["build_kv_events_router"]


def build_kv_events_router(engine: AsyncEngine) -> APIRouter:
    """The discovery route for ``engine``'s event sink (read once per call: the sink is fixed
    for the engine's life)."""
    router = APIRouter()

    @router.get("/kv_events")
    async def kv_events() -> dict[str, Any]:
        sink = engine.engine.kv.events
        if sink is None:
            raise APIError("this worker publishes no KV events (start it with --kv-events-config)",
                           status=404, code="kv_events_disabled", type="not_found_error")
        pub = sink.publisher
        return {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                "topic": pub.topic, "block_size": sink.block_size}

    return router
