"""Owns: the OpenAI dialect's ``POST /v1/completions`` and ``POST /v1/chat/completions`` routes.
Imports: the core's fields.py and json_body.py and this package's protocol.py and serving.py.

The routes check the body's unknown fields and model name, take vLLM's request id (the body's
``request_id``, else the ``X-Request-Id`` header) and hand the body to :class:`OpenAIServing`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixkv.server.fields import FieldPolicy
from prefixkv.server.json_body import FastJSONRoute
from prefixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from prefixkv.server.openai.serving import OpenAIServing

_JSON_OR_EVENTS: dict[int | str, dict[str, Any]] = {200: {
    "description": "the completion as JSON, or with `stream: true` as server-sent events "
                   "(`data: {chunk}` lines, then `data: [DONE]`)",
    "content": {"application/json": {}, "text/event-stream": {"schema": {
        # each event, as OpenAPI 3.2's sequential media types describe one
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    }}},
}}
"""The 200 answers of the completion routes: both media types are documented, so a client
generated from ``/openapi.json`` (and an API fuzzer) expects the stream."""


def _take_request_id(body: CompletionRequest | ChatCompletionRequest, request: Request) -> None:
    """vLLM's request id: the body's ``request_id``, else a usable ``X-Request-Id`` header
    (the router forwards it); an unusable header is ignored, not an error."""
    header = request.headers.get("x-request-id", "")
    if body.request_id is None and 0 < len(header) <= 256 and header.isascii() and header.isprintable() \
            and " " not in header:
        body.request_id = header


def build_openai_router(serving: OpenAIServing, policy: FieldPolicy,
                        check_model: Callable[[str | None], None]) -> APIRouter:
    """``/completions`` and ``/chat/completions`` (mounted under ``/v1``) on ``serving``."""
    router = APIRouter(route_class=FastJSONRoute)  # bodies decoded by msgspec (json_body.py)

    @router.post("/completions", response_model=None, responses=_JSON_OR_EVENTS)
    async def completions(body: CompletionRequest,
                          request: Request) -> JSONResponse | StreamingResponse:
        policy.check(body)
        check_model(body.model)
        _take_request_id(body, request)
        return await serving.completions(body, request.is_disconnected)

    @router.post("/chat/completions", response_model=None, responses=_JSON_OR_EVENTS)
    async def chat_completions(body: ChatCompletionRequest,
                               request: Request) -> JSONResponse | StreamingResponse:
        policy.check(body)
        check_model(body.model)
        _take_request_id(body, request)
        return await serving.chat(body, request.is_disconnected)

    return router
