"""The router's HTTP front: an OpenAI-compatible app over a :class:`~prefixkv.router.proxy.Router`.

Contract. :func:`create_app` builds the FastAPI app: its lifespan starts and stops the router,
its routes parse nothing but what routing needs and leave the rest to the workers.
``POST /v1/completions`` and ``POST /v1/chat/completions`` must carry a JSON object (else a 400
with an OpenAI-style error body); its route key and ``stream`` flag go to ``Router.dispatch``,
which forwards the body unchanged (retries, streaming and failures: see
:mod:`prefixkv.router.proxy`). Also ``GET /v1/models`` (from a healthy worker), ``GET /health``,
``GET /workers`` (the router's view), ``GET /metrics``, and the workers' cache admin routes
fanned out to every worker (:mod:`prefixkv.router.admin`). :class:`RouterServer` serves the app
with uvicorn in a background thread.

Client disconnects. While the router waits for a worker's answer, the request's ASGI ``receive``
channel is watched: when the client goes away, the dispatch is cancelled, which closes the
upstream connection so the worker aborts the request (streams: Starlette cancels the relay).

``WORKER_HEADER``, ``Router`` and ``RouterConfig`` are re-exported here for existing importers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Self

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixkv.router.admin import add_admin_routes
from prefixkv.router.config import RouterConfig
from prefixkv.router.errors import error_response
from prefixkv.router.keys import RouteKey, chat_key, completion_key
from prefixkv.router.local import free_port
from prefixkv.router.metrics import CONTENT_TYPE
from prefixkv.router.proxy import WORKER_HEADER, Router

__all__ = ["WORKER_HEADER", "Router", "RouterConfig", "RouterServer", "create_app",
           "error_response"]


def create_app(config: RouterConfig, *, clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The router's FastAPI app; ``app.state.router`` is its :class:`Router`."""
    router = Router(config, clock=clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="prefixkv router", lifespan=lifespan)
    app.state.router = router

    async def proxy(request: Request, path: str,
                    key_of: Callable[[Any, int], RouteKey]) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}",
                                  type_="invalid_request_error", code="invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object",
                                  type_="invalid_request_error", code="invalid_json")
        key = await router.refine_key(path, body, key_of(body, config.chunk_bytes),
                                      request.headers)
        return await _unless_disconnected(request, router.dispatch(
            path, raw, key, body.get("stream") is True, request.headers))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions", completion_key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions", chat_key)

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health() -> Response:
        healthy = router.workers.healthy()
        return JSONResponse({"status": "ok" if healthy else "no_healthy_worker",
                             "healthy_workers": healthy}, status_code=200 if healthy else 503)

    @app.get("/workers")
    async def workers() -> Response:
        return JSONResponse({"policy": config.policy, "workers": router.describe()})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = router.metrics.render(router.workers, router.policy.describe())
        return Response(text, media_type=CONTENT_TYPE)

    add_admin_routes(app, config.worker_urls, lambda: router.client, config.admin_api_key,
                     config.request_timeout)
    return app


async def _unless_disconnected(request: Request, answer: Awaitable[Response]) -> Response:
    """Await ``answer``; if the client disconnects first, cancel it (closing the upstream
    request) and return a bare 499 that nobody will read."""
    task = asyncio.ensure_future(answer)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the ASGI server reports ``http.disconnect`` (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
