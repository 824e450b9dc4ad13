"""Owns: the cache admin routes (stats, pin, unpin, lookup, reset) and who may call them.
Imports: prefixkv.engine, prefixkv.loopback, bodies.py, errors.py; no dialect.

Cache admin routes (seed 004's ``cache stats | pin | unpin | list-pinned | reset``).

::

    GET  /v1/cache/stats     engine + index counters, "tenants" (cached / retained blocks per
                             cache_salt, its metrics "label", "tier_blocks" per lower tier),
                             "hit_rates" (per tenant and prompt_cache_key over the last window)
    POST /v1/cache/pin       {"token_ids" | "text" | "messages", "description"?, "cache_salt"?,
                             "ttl_s"?, "priority"?: a soft retention instead of a pin}
    POST /v1/cache/unpin     {"token_ids" | "text" | "messages", "cache_salt"?}
    POST /v1/cache/lookup    the same body -> {"prompt_tokens", "cached_tokens": what a request
                             with that prompt would read, "tiers": {"pool", "host", "disk",
                             "remote": the tokens of it each would supply}} (nothing is read or
                             moved; the pool's match refreshes the prefix's recency, as a
                             request's would)
    GET  /v1/cache/pinned    {"object": "list", "data": [pinned prefix, ...]}
    POST /v1/cache/reset     unpin everything, drop every unlocked cached block and the host
                             tier's; ``?tiers=all`` (or body ``{"tiers": "all"}``) also clears
                             the disk and remote tiers (``local`` | ``all`` | ``none`` | names
                             like ``host,disk``); answers the blocks dropped per tier

A prefix that is not cached yet is computed first (a one-token prefill through the engine),
then pinned. Only whole blocks are cached, so a pin covers ``len(prefix) // block_size``
blocks; a prefix shorter than one block is a 400. Errors: 400 for a bad body or a prefix that
cannot be pinned (over ``--max-pinned-blocks`` or ``--max-pinned-blocks-per-tenant``: refused
before anything is computed; longer than the pool), 409 with caching off.

Who may call them (``admin_dependency``): these routes show every tenant's pinned token ids and
``cache_salt``s and can drop everyone's cache, so they are the operator's, not the tenants'.
With ``--admin-api-key`` they need ``Authorization: Bearer <admin key>`` (the inference
``--api-key`` is not enough: 403). Without one, they answer only clients on the loopback
interface that did not come through a proxy (no proxy header at all: ``Forwarded``,
``X-Forwarded-*``, ``X-Real-IP``, ``Via``, ...; :mod:`prefixkv.loopback`), and need the
inference key too when ``--api-key`` is set; anyone else gets 403.

A route that changes state answers ``GET`` (SGLang's ``GET /flush_cache``) only with the admin
key: a ``GET`` is what a page in a local browser can make anyone send (an ``<img>`` tag), so
without ``--admin-api-key`` it is a 403 that says to use ``POST``.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from prefixkv.cache.protocol import PinnedPrefix
from prefixkv.cache.retention import MAX_PRIORITY, Retention
from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.engine.outputs import EngineStats
from prefixkv.engine.residency import HitRate
from prefixkv.loopback import is_local_client, proxy_header
from prefixkv.server.cache_metrics import label as tenant_label
from prefixkv.server.errors import APIError
from prefixkv.server.bodies import LookupRequest, PinRequest, PrefixSpec, UnpinRequest
from prefixkv.server.retention import REQUEST_TTL_S


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def admin_dependency(
    admin_api_key: str | None, api_key: str | None, *, changes_state_on_get: bool = False
) -> Any:
    """The check in front of every cache admin route (see the module docstring);
    ``changes_state_on_get``: the route's ``GET`` changes state (served with the admin key only)."""

    async def check(request: Request) -> None:
        token = _bearer(request)
        if admin_api_key is not None:
            if token is None:
                raise APIError("cache admin routes need 'Authorization: Bearer <admin key>'",
                               status=401, code="invalid_api_key")
            if not hmac.compare_digest(token, admin_api_key):
                raise APIError("this key may not use the cache admin routes (they need the "
                               "admin key)", status=403, code="admin_only")
            return
        host = request.client.host if request.client is not None else None
        if not is_local_client(host, request.headers.keys()):
            via = proxy_header(request.headers.keys())
            why = f" (this one came through a proxy: {via} header)" if via else ""
            raise APIError("cache admin routes are served to loopback clients only" + why +
                           "; start the server with --admin-api-key to manage the cache "
                           "remotely", status=403, code="admin_only")
        if api_key is not None and (token is None or not hmac.compare_digest(token, api_key)):
            raise APIError("invalid or missing API key: send 'Authorization: Bearer <key>'",
                           status=401, code="invalid_api_key")
        if changes_state_on_get and request.method == "GET":
            raise APIError(f"GET {request.url.path} changes the cache: send it as POST, or as "
                           "GET with the admin key (start the server with --admin-api-key)",
                           status=403, code="post_required")

    return check


async def _prompt(engine: AsyncEngine, spec: PrefixSpec) -> list[int] | str | dict[str, Any]:
    """The engine prompt a prefix spec names (token ids, text, or rendered messages)."""
    if spec.token_ids is not None:
        return list(spec.token_ids)
    if spec.text is not None:
        return spec.text
    assert spec.messages is not None
    msgs = [{"role": m.role, "content": m.text()} for m in spec.messages]
    try:
        return await engine.chat_prompt_async(msgs, False)
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


def build_admin_router(engine: AsyncEngine) -> tuple[APIRouter, Callable[..., Awaitable[dict[str, Any]]]]:
    """The ``/cache`` router (mounted under ``/v1`` behind :func:`admin_dependency`) and the
    reset handler (also served at ``/reset_prefix_cache``)."""
    router = APIRouter(prefix="/cache")

    async def require_caching() -> None:
        if not (await engine.get_stats()).enable_prefix_caching:
            raise APIError("prefix caching is disabled on this server "
                           "(started with --no-enable-prefix-caching)", status=409,
                           code="prefix_caching_disabled")

    @router.get("/stats")
    async def stats() -> dict[str, Any]:
        body = _stats_dict(await engine.get_stats())
        tenants, hits, tiers = await engine.call(lambda e: (
            e.cache_admin.tenants(), e.cache_admin.hit_rates(), e.cache_admin.tier_tenants()))
        body["tenants"] = [{**_tenant(ns), "cached_blocks": u.cached_blocks,
                            "retained_blocks": u.retained_blocks} for ns, u in tenants.items()]
        _add_tier_blocks(body["tenants"], list(tenants), tiers)
        body["hit_rates"] = {"window_s": hits.window_s,
                             "tenants": [{**_tenant(ns), **_rate(r)} for ns, r in hits.by_tenant.items()],
                             "prompt_cache_keys": [{"prompt_cache_key": k, **_rate(r)}
                                                   for k, r in hits.by_key.items()]}
        return body

    @router.post("/pin")
    async def pin(body: PinRequest) -> dict[str, Any]:
        await require_caching()
        if body.soft:
            return await _retain(engine, body)
        try:
            pinned = await engine.pin_prefix(await _prompt(engine, body), cache_salt=body.cache_salt,
                                             description=body.description)
        except ValueError as exc:
            raise APIError(str(exc), param=_param(body)) from exc
        return {"pinned": True, **_pinned_dict(pinned)}

    @router.post("/unpin")
    async def unpin(body: UnpinRequest) -> dict[str, Any]:
        await require_caching()
        try:
            ok = await engine.unpin_prefix(await _prompt(engine, body), cache_salt=body.cache_salt)
        except ValueError as exc:
            raise APIError(str(exc), param=_param(body)) from exc
        if not ok:
            raise APIError("that prefix is not pinned", status=404, param=_param(body),
                           code="not_pinned")
        return {"unpinned": True}

    @router.post("/lookup")
    async def lookup(body: LookupRequest) -> dict[str, Any]:
        await require_caching()
        try:
            num, found = await engine.lookup_prefix(await _prompt(engine, body), cache_salt=body.cache_salt)
        except ValueError as exc:
            raise APIError(str(exc), param=_param(body)) from exc
        reusable = found.pop("reusable")
        return {"prompt_tokens": num, "cached_tokens": reusable, "tiers": found}

    @router.get("/pinned")
    async def pinned() -> dict[str, Any]:
        return {"object": "list", "data": [_pinned_dict(p) for p in await engine.list_pinned()]}

    @router.post("/reset")
    async def reset(request: Request, tiers: str | None = None) -> dict[str, Any]:
        if tiers is None:  # the body's form passes through the router's fan-out
            tiers = await _body_tiers(request)
        try:
            cleared = await engine.reset_prefix_cache_tiers(tiers)
        except ValueError as exc:
            raise APIError(str(exc), param="tiers") from exc
        freed = cleared.pop("pool", 0) if cleared is not None else 0
        return {"reset": cleared is not None, "freed_blocks": freed or 0, "tiers": cleared or {}}

    return router, reset


async def _retain(engine: AsyncEngine, body: PinRequest) -> dict[str, Any]:
    """A pin request with ``ttl_s`` / ``priority``: a soft retention (computed first if need be)."""
    keep = Retention(MAX_PRIORITY if body.priority is None else body.priority,
                     REQUEST_TTL_S if body.ttl_s is None else body.ttl_s)
    try:
        blocks = await engine.retain_prefix(await _prompt(engine, body), keep, cache_salt=body.cache_salt)
    except ValueError as exc:  # RetentionError (the tenant's quota) included
        raise APIError(str(exc), param=_param(body)) from exc
    if not blocks:
        raise APIError("the prefix is shorter than one KV block: nothing to retain",
                       param=_param(body))
    return {"pinned": False, "retained": True, "num_blocks": blocks, "priority": keep.priority,
            "ttl_s": keep.ttl_s, "cache_salt": body.cache_salt, "description": body.description}


def _tenant(namespace: Any) -> dict[str, Any]:
    """A tenant (the engine's namespace ``(cache_salt, lora_id)`` or ``None``) as JSON."""
    salt, lora = namespace if isinstance(namespace, tuple) else (namespace, None)
    return {"cache_salt": None if salt is None else str(salt),
            "lora": None if lora is None else str(lora)}


def _add_tier_blocks(rows: list[dict[str, Any]], namespaces: list[Any],
                     tiers: dict[str, dict[str, int]]) -> None:
    """Give each tenant row (one per namespace, same order) its ``label`` (the metrics') and
    ``tier_blocks`` (blocks per lower tier); tenants only the lower tiers hold (e.g. read back
    from disk after a restart) get a row of their own, known by label only."""
    by_label: dict[str, dict[str, Any]] = {}
    for row, ns in zip(rows, namespaces):
        row["label"] = tenant_label(ns)
        row["tier_blocks"] = {}
        by_label[row["label"]] = row
    for tier, counts in tiers.items():
        for name, n in counts.items():
            if name not in by_label:
                by_label[name] = {"cache_salt": None, "lora": None, "label": name,
                                  "cached_blocks": 0, "retained_blocks": 0, "tier_blocks": {}}
                rows.append(by_label[name])
            by_label[name]["tier_blocks"][tier] = n


def _rate(r: HitRate) -> dict[str, Any]:
    return {"requests": r.requests, "hits": r.hits, "queried_tokens": r.queried_tokens,
            "hit_tokens": r.hit_tokens, "token_hit_rate": r.token_hit_rate}


def _param(spec: PrefixSpec) -> str:
    return next(k for k in ("token_ids", "text", "messages") if getattr(spec, k) is not None)


async def _body_tiers(request: Request) -> str:
    """``tiers`` of an optional JSON body (``"local"`` without one)."""
    raw = await request.body()
    if not raw.strip():
        return "local"
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise APIError(f"invalid JSON body: {exc}", param="tiers") from exc
    tiers = body.get("tiers", "local") if isinstance(body, dict) else None
    if isinstance(tiers, list) and all(isinstance(t, str) for t in tiers):
        return ",".join(tiers)
    if not isinstance(tiers, str):
        raise APIError("tiers must be a string or a list of tier names", param="tiers")
    return tiers
