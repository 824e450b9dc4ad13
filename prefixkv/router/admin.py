"""Cache admin through the router: ``/v1/cache/*`` and ``/reset_prefix_cache`` fanned out.

An admin call to the router goes to every worker it knows (healthy or not), or to one with
``?worker=URL``, and the answer lists each worker's::

    {"object": "list", "data": [{"worker": url, "status": 200, "body": {...}}, ...]}

Status: 200 when every worker answered 2xx; else the highest status a worker gave (a worker
that could not be reached counts as 502), so a 403 from workers that refuse the router stays a
403. Who may call (the same rule as a worker's admin routes): with the router's
``admin_api_key`` the client must send ``Authorization: Bearer <it>`` and the router sends it on
to the workers (one admin key for the fleet); without one, only loopback clients that did not
come through a proxy (no proxy header of any kind: :mod:`prefixkv.loopback`), and the router
sends no credential (workers then accept it as a loopback client, or refuse).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixkv.wire.fanout import worker_row
from prefixkv.loopback import is_local_client
from prefixkv.router.errors import error_response

__all__ = ["add_admin_routes", "admin_headers"]

ADMIN_ROUTES = (("GET", "/v1/cache/stats"), ("GET", "/v1/cache/pinned"),
                ("POST", "/v1/cache/pin"), ("POST", "/v1/cache/unpin"), ("POST", "/v1/cache/lookup"),
                ("POST", "/v1/cache/reset"), ("POST", "/reset_prefix_cache"))


def admin_headers(admin_api_key: str | None) -> dict[str, str]:
    """What the router sends a worker on an admin call (and its stats read)."""
    return {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}


def refusal(request: Request, admin_api_key: str | None) -> Response | None:
    """The error answer for a caller the admin rule refuses, or ``None`` when it may proceed."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if admin_api_key is not None:
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), admin_api_key):
            return None
        return error_response(403, "cache admin through the router needs the admin key",
                              type_="permission_error", code="admin_only")
    host = request.client.host if request.client is not None else None
    if is_local_client(host, request.headers.keys()):  # no proxy header of any kind
        return None
    return error_response(403, "cache admin through the router is served to loopback clients "
                          "only; start it with --admin-api-key", type_="permission_error",
                          code="admin_only")


def add_admin_routes(app: FastAPI, worker_urls: tuple[str, ...], client: Any,
                     admin_api_key: str | None, timeout: float) -> None:
    """Mount the fan-out routes on ``app``; ``client()`` returns the router's httpx client."""

    async def one(url: str, method: str, path: str, body: bytes) -> dict[str, Any]:
        headers = {**admin_headers(admin_api_key), "content-type": "application/json"}
        try:
            resp = await client().request(method, url + path, content=body or None,
                                          headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            return worker_row(url, 502, {"error": {
                "message": f"worker unreachable: {exc!r}", "type": "worker_error",
                "param": None, "code": "worker_unreachable"}})
        try:
            payload: Any = resp.json()
        except ValueError:
            payload = resp.text
        return worker_row(url, resp.status_code, payload)

    def handler(method: str, path: str) -> Any:
        async def fan_out(request: Request) -> Response:
            refused = refusal(request, admin_api_key)
            if refused is not None:
                return refused
            wanted = request.query_params.get("worker")
            urls = worker_urls if wanted is None else tuple(
                u for u in worker_urls if u == wanted.rstrip("/"))
            if not urls:
                return error_response(404, f"no worker {wanted!r} behind this router",
                                      type_="not_found_error", param="worker")
            body = await request.body()
            if body:
                try:
                    json.loads(body)
                except ValueError as exc:
                    return error_response(400, f"request body is not valid JSON: {exc}",
                                          type_="invalid_request_error", code="invalid_json")
            data = await asyncio.gather(*(one(u, method, path, body) for u in urls))
            worst = max(d["status"] for d in data)
            return JSONResponse({"object": "list", "data": list(data)},
                                status_code=200 if worst < 300 else worst)

        return fan_out

    for method, path in ADMIN_ROUTES:
        app.add_api_route(path, handler(method, path), methods=[method])
