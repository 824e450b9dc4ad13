"""The router's HTTP front: an OpenAI-compatible app over a :class:`~prefixkv.router.proxy.Router`.

Contract. :func:`create_app` builds the router's ASGI app (:class:`RouterApp`). The proxied
routes, ``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, Anthropic's
``/v1/messages`` and SGLang's ``/generate`` (and vLLM's render routes), are served over raw ASGI
(the request path the router adds latency on: one body read, one JSON parse, the route key, the
dispatch): the body must be a JSON object (else a 400 with an OpenAI-style error body); its route
key and ``stream`` flag go to ``Router.dispatch``, which forwards the body unchanged (retries,
streaming and failures: see :mod:`prefixkv.router.proxy`). Every other route, and the lifespan
that starts and stops the router, is a FastAPI app's: ``GET /v1/models`` (from a healthy
worker), ``GET`` / ``DELETE /v1/responses/{id}`` and its ``/input_items`` (from the worker
holding it), ``GET /health``,
``GET /workers`` (the router's view), ``GET /metrics``, ``POST /router/learn`` (what another
router replica routed: :mod:`prefixkv.router.replicas`), and the
workers' cache admin routes fanned out to every worker (:mod:`prefixkv.router.admin`). :class:`RouterServer` serves the app
with uvicorn in a background thread.

Client disconnects. From its body's arrival to the answer's end (streams included), a proxied
request's ASGI ``receive`` channel is watched: when the client goes away, the request's task is
cancelled, which aborts the upstream connection so the worker aborts the request.

``WORKER_HEADER``, ``Router`` and ``RouterConfig`` are re-exported here for existing importers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from prefixkv.router.admin import add_admin_routes, admin_headers
from prefixkv.router.admin import refusal as admin_refusal
from prefixkv.router.answer import error_answer, send_answer
from prefixkv.router.config import RouterConfig
from prefixkv.router.errors import error_response
from prefixkv.router.keys import (
    RouteKey,
    chat_key,
    completion_key,
    generate_key,
    hinted_key,
    messages_key,
    responses_key,
)
from prefixkv.router.local import free_port
from prefixkv.router.metrics import CONTENT_TYPE
from prefixkv.router.proxy import WORKER_HEADER, Router
from prefixkv.router.replicas import (
    PeerLoads,
    ReplicaSync,
    decode_learn,
    learning_policy,
)

__all__ = ["WORKER_HEADER", "Router", "RouterApp", "RouterConfig", "RouterServer", "create_app",
           "error_response"]

log = logging.getLogger("prefixkv.router")


def create_app(config: RouterConfig, *, clock: Callable[[], float] = time.monotonic) -> RouterApp:
    """The router's ASGI app; ``app.state.router`` is its :class:`Router`."""
    router = Router(config, clock=clock)
    learner = learning_policy(router.policy)
    def in_flight() -> dict[str, int]:  # only a learning policy adds its peers' loads to its own
        return {w.url: w.in_flight for w in router.workers.all()} if learner is not None else {}

    sync = ReplicaSync(config.peer_urls, interval=config.peer_sync_interval,
                       headers=admin_headers(config.admin_api_key), loads=in_flight) if (
        config.peer_urls) else None  # replicas share their quarantine whatever their policy
    if sync is not None and learner is not None:
        learner.peer_loads = PeerLoads(ttl=max(1.0, 50 * config.peer_sync_interval),
                                       clock=clock)
        learner.replica_index = config.replica_index

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        if sync is not None:
            if learner is not None:
                learner.listener = sync.note
            router.quarantine.listener = sync.note_quarantine
            await sync.start(router.client)
        try:
            yield
        finally:
            if sync is not None:
                await sync.stop()
            await router.stop()

    app = FastAPI(title="prefixkv router", lifespan=lifespan)
    app.state.router = router

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # uptime probes ask HEAD; no body
    async def health() -> Response:
        healthy = router.workers.healthy()
        return JSONResponse({"status": "ok" if healthy else "no_healthy_worker",
                             "healthy_workers": healthy}, status_code=200 if healthy else 503)

    @app.get("/workers")
    async def workers() -> Response:
        return JSONResponse({"policy": config.policy, "workers": router.describe()})

    @app.get("/metrics")
    @app.head("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        text = router.metrics.render(router.workers, router.policy.describe())
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_response(response_id: str, request: Request) -> Response:
        rest = request.url.path.split(f"/v1/responses/{response_id}", 1)[1]
        return await router.stored_response(request.method, response_id, request.headers,
                                            rest + (f"?{request.url.query}" if request.url.query else ""))

    @app.post("/router/learn")
    async def learn(request: Request) -> Response:
        refused = admin_refusal(request, config.admin_api_key)
        if refused is not None:
            return refused
        body = await request.body()
        try:
            replica, loads, entries, quarantine = decode_learn(body)
        except ValueError as exc:
            return error_response(400, f"router/learn: {exc}", type_="invalid_request_error",
                                  code="invalid_value")
        if learner is not None and learner.peer_loads is not None:
            learner.peer_loads.update(replica, loads)
        learned = sum(learner.learn(url, key) for url, key in entries) if learner else 0
        for fp, seconds, condemned in quarantine:
            router.quarantine.learn(fp, seconds, condemned)
        return JSONResponse({"learned": learned, "skipped": len(entries) - learned,
                             "quarantine": len(quarantine)})

    add_admin_routes(app, config.worker_urls, lambda: router.client, config.admin_api_key,
                     config.request_timeout)
    return RouterApp(app, router)


class RouterApp:
    """The router's ASGI app: the proxied POST routes handled here over raw ASGI (one body
    read, one JSON parse, no framework layers), everything else (lifespan included) by the
    FastAPI app ``api``."""

    def __init__(self, api: FastAPI, router: Router) -> None:
        self.api, self.router, self.state = api, router, api.state
        self._chunk_bytes = router.config.chunk_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            key_of = PROXIED_ROUTES.get(scope["path"])
            if key_of is not None:
                await self._proxy(scope, receive, send, key_of)
                return
        await self.api(scope, receive, send)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send,
                     key_of: Callable[[Any, int], RouteKey]) -> None:
        raw = await _read_body(receive)
        if raw is None:
            return  # the client left before sending its body
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            await send_answer(send, error_answer(400, f"request body is not valid JSON: {exc}",
                                                 type_="invalid_request_error",
                                                 code="invalid_json"))
            return
        if not isinstance(body, dict):
            await send_answer(send, error_answer(400, "request body must be a JSON object",
                                                 type_="invalid_request_error",
                                                 code="invalid_json"))
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path: str = scope["path"]
        # the client leaving cancels this task: the dispatch or the relay unwinds and aborts
        # its upstream connection, so the worker aborts the request too
        me = asyncio.current_task()
        state = {"finished": False, "left": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["finished"] and me is not None:
                state["left"] = True
                me.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            router = self.router
            try:
                key = await router.refine_key(path, body, hinted_key(key_of, body, self._chunk_bytes),
                                              headers)
                after = body.get("previous_response_id")
                answer = await router.dispatch(path, raw, key, body.get("stream") is True,
                                               headers, after=after if isinstance(after, str) else None)
            except Exception as exc:  # a bug: this request fails alone, with an OpenAI body
                log.exception("routing %s failed", path)
                answer = error_answer(500, f"router error: {type(exc).__name__}: {exc}",
                                      type_="internal_error", code="router_error")
            await send_answer(send, answer)
        except asyncio.CancelledError:
            if not state["left"]:
                raise
            if me is not None and hasattr(me, "uncancel"):
                me.uncancel()
        finally:
            state["finished"] = True
            watcher.cancel()


PROXIED_ROUTES: dict[str, Callable[[Any, int], RouteKey]] = {
    "/v1/completions": completion_key, "/v1/chat/completions": chat_key,
    "/generate": generate_key,  # SGLang's native API
    "/v1/responses": responses_key, "/v1/messages": messages_key,  # Anthropic's
    "/v1/messages/count_tokens": messages_key,
    # vLLM's render API: to the worker the request itself would go to (same tokenizer, and the
    # real request that usually follows finds its prefix there)
    "/v1/completions/render": completion_key, "/v1/chat/completions/render": chat_key}
"""The proxied POST paths and how each builds its route key from a parsed body (the HTTP router
and the endpoint picker, :mod:`prefixkv.router.epp`, route from this one table)."""


async def _read_body(receive: Receive) -> bytes | None:
    """The request body, or ``None`` when the client disconnects first."""
    pieces = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        pieces.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(pieces)


class RouterServer:
    """The router app served by uvicorn in a background thread (tests, benchmarks).

    ``with RouterServer(config) as server: ... server.url ...``; leaving stops it.
    """

    def __init__(self, config: RouterConfig, *, host: str = "127.0.0.1", port: int | None = None):
        self.app = create_app(config)
        self.router: Router = self.app.state.router
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, host=host, port=self.port, log_level="warning", lifespan="on",
            timeout_keep_alive=config.timeout_keep_alive,
        ))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self, timeout: float = 30.0) -> Self:
        """Start serving; ``RuntimeError`` if it is not up within ``timeout`` seconds."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"router did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for it."""
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
