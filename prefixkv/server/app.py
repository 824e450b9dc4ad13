"""Owns: the app factory: health, metrics, models, auth; it mounts every dialect's routes.
Imports: every server module (the one core module that imports the dialects) and prefixkv.engine.

The FastAPI app: OpenAI-compatible routes, health, metrics and the cache admin API.

``create_app(engine)`` wires an already running ``AsyncEngine`` (owned by the caller, who
shuts it down) to HTTP. Routes::

    GET  /health (also GET/POST /ping) 200 {"status": "ok"} (HEAD: the status, no body)
    GET  /metrics                     Prometheus text (see metrics.py; HEAD too)
    GET  /v1/models                   the served model names (with max_model_len)
    GET  /v1/models/{id}              one of them
    POST /v1/completions              OpenAI completions (stream, n, stop, logprobs, echo, ...)
    POST /v1/chat/completions         OpenAI chat completions (logprobs, response_format, tools)
    POST /tokenize, /detokenize       vLLM's tokenizer routes (see openai/tokenizer_routes.py)
    GET  /tokenizer_info, /version
    /v1/cache/...                     cache admin (see admin.py)
    POST /reset_prefix_cache          vLLM's name for POST /v1/cache/reset
    POST /generate, /flush_cache,     SGLang's native API (sglang/routes.py)
    GET  /model_info

With ``api_key`` set, every ``/v1/*`` inference route needs ``Authorization: Bearer
<api_key>`` (else 401); ``/health`` and ``/metrics`` stay open. The cache admin routes
(``/v1/cache/*``, ``/reset_prefix_cache``) are the operator's: ``admin_api_key``, or loopback
only without one (see ``admin.py``). ``limits`` caps what one request may ask (body size,
``n``, prompts per batch, chat's default length; see ``limits.py``).

Errors are 4xx/5xx with OpenAI-style bodies; the OpenAPI schema says so (validation errors
are 400s with that body, not FastAPI's 422).
"""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.server.admin import admin_dependency, build_admin_router
from prefixkv.server.errors import APIError, install_error_handlers
from prefixkv.server.fields import FieldPolicy
from prefixkv.server.kv_events import build_kv_events_router
from prefixkv.server.limits import BodySizeLimit, ServerLimits
from prefixkv.server.prompt_body import PromptBodyLimit
from prefixkv.server.cache_metrics import cache_view
from prefixkv.server.engine_metrics import engine_gauges
from prefixkv.server.loop_lag import LoopLag
from prefixkv.server.metrics import CONTENT_TYPE, ServerMetrics
from prefixkv.server.openai.serving import OpenAIServing
from prefixkv.server.anthropic.messages_stream import build_messages_router
from prefixkv.engine.lora import lora_requests_info
from prefixkv.server.lora_routes import adapter_names, adapter_of, build_lora_router
from prefixkv.server.openai.render_routes import build_render_router
from prefixkv.server.openai.routes import build_openai_router
from prefixkv.server.openai.responses_stream import build_responses_router
from prefixkv.server.sglang.routes import build_sglang_router
from prefixkv.server.tracing import install_tracing
from prefixkv.server.openai.tokenizer_routes import build_tokenizer_router

DEFAULT_MODEL_NAME = "prefixkv-demo"


def _auth_dependency(api_key: str | None) -> Any:
    """A dependency that rejects requests without ``Authorization: Bearer <api_key>``."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
            raise APIError("invalid or missing API key: send 'Authorization: Bearer <key>'",
                           status=401, code="invalid_api_key")

    return check


def create_app(engine: AsyncEngine, *, api_key: str | None = None,
               admin_api_key: str | None = None, limits: ServerLimits | None = None,
               model_name: str = DEFAULT_MODEL_NAME, model_aliases: tuple[str, ...] = (),
               served_model_names: tuple[str, ...] = (), strict_fields: bool = False,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """Build the app for ``engine`` (not owned: the caller shuts it down).

    ``model_name`` is what responses report; ``/v1/models`` lists it and the other
    ``served_model_names`` (vLLM's several ``--served-model-name``). Requests may name any of
    them or one of ``model_aliases`` (e.g. the model's path); anything else is a 404.
    Unknown request fields are ignored with one warning per name, or refused with
    ``strict_fields`` (see ``fields.py``).
    ``on_shutdown`` runs when the ASGI server shuts the app down (``prefixkv serve`` stops the
    engine thread there, before uvicorn re-raises SIGTERM).
    """

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            async with loop_lag.running():
                yield
        finally:
            if on_shutdown is not None:
                on_shutdown()
            if tracer is not None:  # last: a collector that is down only delays the exit
                tracer.shutdown()  # the spans still queued go out

    app = FastAPI(title="prefixkv", version="0.1.0", docs_url="/docs", redoc_url=None,
                  lifespan=lifespan)
    limits = limits if limits is not None else ServerLimits()
    app.add_middleware(BodySizeLimit, limit=limits.max_body_bytes)
    app.add_middleware(PromptBodyLimit, max_model_len=engine.max_model_len,  # 413 unread
                       max_body_bytes=limits.max_body_bytes)
    metrics = ServerMetrics(model_name)
    loop_lag = LoopLag(metrics.registry, model_name)  # prefixkv:event_loop_lag_seconds
    install_error_handlers(app, on_error=metrics.observe_error)
    tracer = install_tracing(app, limits.otlp_traces_endpoint)
    serving = OpenAIServing(engine, model_name, metrics, limits, tracer)
    listed = tuple(dict.fromkeys((model_name, *served_model_names)))
    known_models = {*listed, *model_aliases}
    policy = FieldPolicy(strict=strict_fields)
    app.state.field_policy = policy
    created = int(time.time())
    app.state.engine = engine
    app.state.metrics = metrics

    def check_model(name: str | None) -> None:
        if name is not None and name not in known_models and adapter_of(engine, name) is None:
            raise APIError(f"the model {name!r} does not exist; this server serves "
                           f"{[*listed, *adapter_names(engine)]}", status=404, param="model",
                           code="model_not_found")

    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # uptime probes ask HEAD; 200, no body
    @app.get("/ping")  # vLLM's SageMaker-style alias
    @app.post("/ping")
    async def health() -> dict[str, str]:
        if not engine.is_running:
            raise APIError("the engine is not running", status=503, code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text exposition", "content": {CONTENT_TYPE: {}}}})
    @app.head("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        gauges = engine_gauges(await engine.get_stats(), await engine.call(cache_view))
        metrics.set_lora(await engine.call(lora_requests_info))
        return Response(metrics.render(gauges), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_auth_dependency(api_key))])

    def card(name: str) -> dict[str, Any]:
        adapter = adapter_of(engine, name) is not None and name not in known_models
        return {"id": name, "object": "model", "created": created, "owned_by": "prefixkv",
                "root": model_name, "parent": model_name if adapter else None,
                "max_model_len": engine.max_model_len, "permission": []}

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [card(name) for name in
                                           (*listed, *adapter_names(engine))]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return card(model_id)

    v1.include_router(build_openai_router(serving, policy, check_model))
    v1.include_router(build_responses_router(serving, policy, check_model))
    v1.include_router(build_messages_router(serving, policy, check_model))
    v1.include_router(build_render_router(serving, policy, check_model))
    app.include_router(v1)
    app.include_router(build_tokenizer_router(engine, check_model, policy),
                       dependencies=[Depends(_auth_dependency(api_key))])
    app.include_router(build_kv_events_router(engine),
                       dependencies=[Depends(_auth_dependency(api_key))])
    admin, reset = build_admin_router(engine)
    admin_check = [Depends(admin_dependency(admin_api_key, api_key))]
    app.include_router(admin, prefix="/v1", dependencies=admin_check)
    app.include_router(build_lora_router(engine, model_name), prefix="/v1",
                       dependencies=admin_check)
    app.add_api_route("/reset_prefix_cache", reset, methods=["POST"], dependencies=admin_check)
    sglang, flush = build_sglang_router(engine, policy, model_name, limits, metrics, tracer)
    app.include_router(sglang, dependencies=[Depends(_auth_dependency(api_key))])
    get_check = [Depends(admin_dependency(admin_api_key, api_key, changes_state_on_get=True))]
    for method in ("POST", "GET"):  # SGLang answers both; one route each (distinct OpenAPI ids)
        app.add_api_route("/flush_cache", flush, methods=[method],
                          dependencies=admin_check if method == "POST" else get_check,
                          operation_id=f"flush_cache_{method.lower()}")
    app.openapi = lambda: _openapi_with_error_bodies(app)  # type: ignore[method-assign]
    return app


_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "integer", "null"]}}}},
}


_AUTHED_PATHS = {"/reset_prefix_cache", "/tokenize", "/detokenize", "/tokenizer_info", "/version",
                 "/kv_events", "/generate", "/flush_cache", "/model_info", "/get_model_info"}


def _openapi_with_error_bodies(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with what the server really answers on errors: 400 (not 422) and the
    OpenAI error body on every error status an operation can return."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    error = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = ["400", "413", "500", "503"] if method == "post" else ["500", "503"]
            if any(p.get("in") == "query" for p in op.get("parameters", [])):
                codes.append("400")  # a bad query parameter
            if path.startswith("/v1") or path in _AUTHED_PATHS:
                codes += ["401", "403", "404"]
            for code in codes:
                responses.setdefault(code, {"description": "error", **error})
    comps = schema.get("components", {}).get("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    app.openapi_schema = schema
    return schema
