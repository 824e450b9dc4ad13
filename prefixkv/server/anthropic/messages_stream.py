"""Owns: the Messages routes and Anthropic's event stream.
Imports: the server core, messages.py and server.openai (the chat completion it runs as).

The Messages API routes and their event stream (:mod:`prefixkv.server.anthropic.messages` has the
request model and the translation to and from a chat completion).

A streamed message is Anthropic's event sequence, each ``event: <type>`` + ``data: {json}``:
``message_start`` (the message with no content and the prompt's usage: what was read from the
cache is known once the prompt is prefilled, so it follows the first token), for text
``content_block_start`` / ``content_block_delta`` (``text_delta``) / ``content_block_stop``, for
each tool call a ``tool_use`` block with one ``input_json_delta``, then ``message_delta``
(``stop_reason``, ``stop_sequence``, the final ``usage``) and ``message_stop``. An engine failure
mid-stream is an ``error`` event. Closing the stream (the client left) closes the chat stream
under it, which aborts the engine request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from prefixkv.engine.outputs import RequestOutput
from prefixkv.server.errors import APIError
from prefixkv.server.fields import FieldPolicy
from prefixkv.server.limits import check_prompt_chars
from prefixkv.server.anthropic.messages import (
    CountTokensRequest,
    MessagesRequest,
    chat_body,
    content_blocks,
    count_body,
    message_object,
    stop_reason,
)
from prefixkv.server.anthropic.cache_control import (CacheWrites, breakpoints, render_cuts, retain,
                                                     usage)
from prefixkv.server.lora_routes import adapter_of
from prefixkv.server.openai.protocol import ChatCompletionRequest
from prefixkv.server.openai.responses import new_id
from prefixkv.server.openai.responses_stream import add_tool_calls, chat_chunks
from prefixkv.server.openai.serving import OpenAIServing
from prefixkv.server.streaming import EngineStreamingResponse, sse


def build_messages_router(serving: OpenAIServing, policy: FieldPolicy,
                          check_model: Callable[[str | None], None]) -> APIRouter:
    """``/messages`` routes (mounted under ``/v1``) running on ``serving``'s chat path."""
    router = APIRouter()

    @router.post("/messages", response_model=None)
    async def create(body: MessagesRequest, request: Request) -> Response:
        check_prompt_chars(serving.engine.max_model_len, _prompt_fields(body))
        policy.check(body)
        check_model(body.model)
        try:
            chat = ChatCompletionRequest.model_validate(chat_body(body))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise APIError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}", param="messages") from exc
        marks, writes = breakpoints(body), CacheWrites()
        hook = None
        if marks:
            cuts = asyncio.ensure_future(render_cuts(serving.engine, marks))  # beside the prefill

            async def hook(out: RequestOutput) -> None:  # the breakpoints' retention
                await retain(serving.engine, marks, cuts, out, writes,
                             cache_salt=chat.cache_namespace,
                             lora=adapter_of(serving.engine, chat.model))

        answer = await serving.chat(chat, request.is_disconnected, hook)
        mid = new_id("msg")
        if isinstance(answer, StreamingResponse):
            return EngineStreamingResponse(
                _events(mid, serving.served_name(body.model), answer.body_iterator, writes),
                media_type="text/event-stream")
        data = json.loads(bytes(answer.body))
        choice = data["choices"][0]
        return JSONResponse(message_object(
            mid, data["model"], content_blocks(choice["message"]),
            stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(choice["message"].get("tool_calls"))),
            usage(data.get("usage"), writes)))

    @router.post("/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        check_prompt_chars(serving.engine.max_model_len, _prompt_fields(body))
        policy.check(body)
        check_model(body.model)
        breakpoints(body)  # checked as a request's are
        messages, tools = count_body(body)
        try:
            extra: dict[str, Any] = {"tools": tools} if tools else {}
            prompt = await serving.engine.chat_prompt_async(messages, True, **extra)
        except ValueError as exc:
            raise APIError(f"cannot render messages: {exc}", param="messages") from exc
        return {"input_tokens": len(prompt["prompt_token_ids"])}

    return router


def _prompt_fields(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The fields whose text the prompt is made of (the length guard's input)."""
    return {"messages": body.messages, "system": body.system, "tools": body.tools}


def _event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, **fields}, event=kind)


async def _events(mid: str, model: str, chat: AsyncIterable[Any], writes: CacheWrites
                  ) -> AsyncIterator[bytes]:
    """The events of one streamed message (``writes``: what its breakpoints created, filled
    once its prompt is computed); closing this closes ``chat`` (aborting its request)."""
    started = text_open = False
    calls: dict[int, dict[str, str]] = {}
    finish: str | None = None
    matched: Any = None
    chat_usage: dict[str, Any] | None = None
    try:
        async for chunk in chat_chunks(chat):
            if "error" in chunk:  # the engine failed after the stream started
                yield _event("error", error={"type": "api_error", "message": chunk["error"].get("message")})
                return
            chat_usage = chunk.get("usage") or chat_usage
            if not started:
                start = usage(chat_usage, writes)
                start["output_tokens"] = 0
                yield _event("message_start", message=message_object(mid, model, [], (None, None), start))
                started = True
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                add_tool_calls(calls, delta)
                if delta.get("content") and not delta.get("tool_calls"):
                    if not text_open:
                        yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                        text_open = True
                    yield _event("content_block_delta", index=0,
                                 delta={"type": "text_delta", "text": delta["content"]})
                if choice.get("finish_reason"):
                    finish, matched = choice["finish_reason"], choice.get("stop_reason")
    finally:
        aclose = getattr(chat, "aclose", None)
        if aclose is not None:
            await aclose()
    if not started:  # (a chat stream always sends a chunk first; kept for safety)
        yield _event("message_start", message=message_object(mid, model, [], (None, None), usage(None, writes)))
    index = 0
    if text_open or not calls:
        if not text_open:
            yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield _event("content_block_stop", index=0)
        index = 1
    for _, c in sorted(calls.items()):
        yield _event("content_block_start", index=index,
                     content_block={"type": "tool_use", "id": c["id"], "name": c["name"], "input": {}})
        yield _event("content_block_delta", index=index,
                     delta={"type": "input_json_delta", "partial_json": c["arguments"]})
        yield _event("content_block_stop", index=index)
        index += 1
    reason = stop_reason(finish, matched, bool(calls))
    yield _event("message_delta", delta={"stop_reason": reason[0], "stop_sequence": reason[1]},
                 usage=usage(chat_usage, writes))
    yield _event("message_stop")
