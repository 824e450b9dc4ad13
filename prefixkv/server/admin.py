"""Cache admin routes (seed 004's ``cache stats | pin | unpin | list-pinned | reset``).

::

    GET  /v1/cache/stats     engine + index counters
    POST /v1/cache/pin       {"token_ids" | "text" | "messages", "description"?, "cache_salt"?}
    POST /v1/cache/unpin     {"token_ids" | "text" | "messages", "cache_salt"?}
    GET  /v1/cache/pinned    {"object": "list", "data": [pinned prefix, ...]}
    POST /v1/cache/reset     unpin everything, drop every unlocked cached block

A prefix that is not cached yet is computed first (a one-token prefill through the engine),
then pinned. Only whole blocks are cached, so a pin covers ``len(prefix) // block_size``
blocks; a prefix shorter than one block is a 400. Errors: 400 for a bad body or a prefix that
cannot be pinned (over ``--max-pinned-blocks``, longer than the pool), 409 with caching off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter

from prefixkv.cache.protocol import PinnedPrefix
from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.engine.outputs import EngineStats
from prefixkv.server.errors import APIError
from prefixkv.server.protocol import PinRequest, PrefixSpec, UnpinRequest
from prefixkv.server.serving import render_chat


def _prompt(engine: AsyncEngine, spec: PrefixSpec) -> list[int] | str | dict[str, Any]:
    """The engine prompt a prefix spec names (token ids, text, or rendered messages)."""
    if spec.token_ids is not None:
        return list(spec.token_ids)
    if spec.text is not None:
        return spec.text
    assert spec.messages is not None
    msgs = [{"role": m.role, "content": m.text()} for m in spec.messages]
    try:
        return render_chat(engine, msgs, add_generation_prompt=False)
    except ValueError as exc:
        raise APIError(f"cannot render messages: {exc}", param="messages") from exc


def _pinned_dict(p: PinnedPrefix) -> dict[str, Any]:
    """A pinned prefix as JSON; the engine's namespace ``(cache_salt, lora_id)`` is reported
    as its ``cache_salt``."""
    ns = p.namespace
    salt = ns[0] if isinstance(ns, tuple) else ns
    return {
        "token_ids": list(p.token_ids),
        "num_tokens": len(p.token_ids),
        "num_blocks": p.num_blocks,
        "cache_salt": None if salt is None else str(salt),
        "description": p.description,
        "pinned_at": p.pinned_at,
    }


def _stats_dict(s: EngineStats) -> dict[str, Any]:
    body = {k: v for k, v in dataclasses.asdict(s).items() if k != "cache"}
    body["cache"] = dataclasses.asdict(s.cache) if s.cache is not None else None
    return body


def build_admin_router(engine: AsyncEngine) -> tuple[APIRouter, Callable[[], Awaitable[dict[str, Any]]]]:
    """The ``/cache`` router (mounted under ``/v1``) and the reset handler (also served at
    ``/reset_prefix_cache``)."""
    router = APIRouter(prefix="/cache")

    async def require_caching() -> None:
        if not (await engine.get_stats()).enable_prefix_caching:
            raise APIError("prefix caching is disabled on this server "
                           "(started with --no-enable-prefix-caching)", status=409,
                           code="prefix_caching_disabled")

    @router.get("/stats")
    async def stats() -> dict[str, Any]:
        return _stats_dict(await engine.get_stats())

    @router.post("/pin")
    async def pin(body: PinRequest) -> dict[str, Any]:
        await require_caching()
        try:
            pinned = await engine.pin_prefix(_prompt(engine, body), cache_salt=body.cache_salt,
                                             description=body.description)
        except ValueError as exc:
            raise APIError(str(exc), param=_param(body)) from exc
        return {"pinned": True, **_pinned_dict(pinned)}

    @router.post("/unpin")
    async def unpin(body: UnpinRequest) -> dict[str, Any]:
        await require_caching()
        try:
            ok = await engine.unpin_prefix(_prompt(engine, body), cache_salt=body.cache_salt)
        except ValueError as exc:
            raise APIError(str(exc), param=_param(body)) from exc
        if not ok:
            raise APIError("that prefix is not pinned", status=404, param=_param(body),
                           code="not_pinned")
        return {"unpinned": True}

    @router.get("/pinned")
    async def pinned() -> dict[str, Any]:
        return {"object": "list", "data": [_pinned_dict(p) for p in await engine.list_pinned()]}

    @router.post("/reset")
    async def reset() -> dict[str, Any]:
        before = (await engine.get_stats()).num_cached_blocks
        done = await engine.reset_prefix_cache()
        after = (await engine.get_stats()).num_cached_blocks
        return {"reset": done, "freed_blocks": max(0, before - after)}

    return router, reset


def _param(spec: PrefixSpec) -> str:
    return next(k for k in ("token_ids", "text", "messages") if getattr(spec, k) is not None)
