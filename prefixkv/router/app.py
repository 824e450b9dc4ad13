"""The router's HTTP front: an OpenAI-compatible app over a :class:`~prefixkv.router.proxy.Router`.

Contract. :func:`create_app` builds the FastAPI app: its lifespan starts and stops the router,
its routes parse nothing but what routing needs and leave the rest to the workers.
``POST /v1/completions`` and ``POST /v1/chat/completions`` must carry a JSON object (else a 400
with an OpenAI-style error body); its route key and ``stream`` flag go to ``Router.dispatch``,
which forwards the body unchanged (retries, streaming and failures: see
:mod:`prefixkv.router.proxy`). Also ``GET /v1/models`` (from a healthy worker), ``GET /health``,
``GET /workers`` (the router's view) and ``GET /metrics``. :class:`RouterServer` serves the app
with uvicorn in a background thread.

``WORKER_HEADER``, ``Router`` and ``RouterConfig`` live in :mod:`prefixkv.router.proxy` and are
re-exported here for existing importers.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixkv.router.metrics import CONTENT_TYPE
from prefixkv.router.proxy import WORKER_HEADER, Router, RouterConfig, error_response
from prefixkv.router.tree import RouteKey, chat_key, completion_key
from prefixkv.router.workers import free_port

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

    async def proxy(request: Request, path: str, key_of: Callable[[Any], RouteKey]) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}",
                                  type_="invalid_request_error", code="invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object",
                                  type_="invalid_request_error", code="invalid_json")
        return await router.dispatch(path, raw, key_of(body), body.get("stream") is True,
                                     request.headers)

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
        sizes = router.trees.sizes() if router.trees is not None else {}
        return Response(router.metrics.render(router.workers, sizes), media_type=CONTENT_TYPE)

    return app


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
