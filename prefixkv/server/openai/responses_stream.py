"""Owns: the Responses routes and the Responses event stream.
Imports: the server core and this package's protocol, responses, responses_store, serving.

The Responses API routes and their event stream (:mod:`prefixkv.server.openai.responses` has the
request model and the translation to and from a chat completion).

A streamed response is OpenAI's event sequence, each event ``event: <type>`` + ``data: {json}``
with a ``sequence_number``: ``response.created``, ``response.in_progress``; for text
``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per chat delta, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; for function calls
``response.output_item.added``, ``response.function_call_arguments.delta`` / ``.done``,
``response.output_item.done``; then ``response.completed`` (``response.incomplete`` when cut by
``max_output_tokens``) with the whole response and its usage. An engine failure mid-stream is an
``error`` event then ``response.failed``. Closing the stream (the client left) closes the chat
stream under it, which aborts the engine request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from prefixkv.server.errors import APIError
from prefixkv.server.fields import FieldPolicy
from prefixkv.server.limits import check_prompt_chars
from prefixkv.server.openai.protocol import ChatCompletionRequest
from prefixkv.server.openai.responses import (
    RESPONSE_ID_HEADER,
    ResponsesRequest,
    assistant_turn,
    chat_body,
    chat_error,
    finished_status,
    input_messages,
    new_id,
    now,
    output_items,
    response_object,
    usage,
)
from prefixkv.server.openai.responses_store import ResponseStore, input_records
from prefixkv.server.openai.serving import OpenAIServing
from prefixkv.server.streaming import EngineStreamingResponse, sse


def build_responses_router(serving: OpenAIServing, policy: FieldPolicy,
                           check_model: Callable[[str | None], None],
                           store: ResponseStore | None = None) -> APIRouter:
    """``/responses`` routes (mounted under ``/v1``) running on ``serving``'s chat path."""
    store = store if store is not None else ResponseStore()
    router = APIRouter()

    @router.post("/responses", response_model=None)
    async def create(body: ResponsesRequest, request: Request) -> Response:
        check_prompt_chars(serving.engine.max_model_len, {
            "input": body.input, "instructions": body.instructions, "tools": body.tools})
        policy.check(body)
        check_model(body.model)
        refused = body.refused()
        if refused is not None:
            raise APIError(refused[1], param=refused[0])
        history = store.conversation(body.previous_response_id) if body.previous_response_id else []
        history += input_messages(body.input)
        try:
            chat = ChatCompletionRequest.model_validate(chat_body(body, history))
            answer = await serving.chat(chat, request.is_disconnected)
        except (APIError, ValidationError) as exc:
            raise chat_error(exc) from exc
        rid, created = new_id("resp"), now()
        headers = {RESPONSE_ID_HEADER: rid} if body.store else None
        if isinstance(answer, StreamingResponse):
            events = _Events(rid, body, serving.served_name(body.model), created, store, history)
            return EngineStreamingResponse(events.run(answer.body_iterator), headers=headers,
                                           media_type="text/event-stream")
        data = json.loads(bytes(answer.body))
        choice = data["choices"][0]
        output = output_items(choice["message"], (choice.get("logprobs") or {}).get("content"))
        resp = response_object(rid, body, data["model"], status=finished_status(choice["finish_reason"]),
                               output=output, usage_=usage(data.get("usage")), created=created)
        if body.store:
            store.put(resp, history + assistant_turn(output), input_records(body.input))
        return JSONResponse(resp, headers=headers)

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return store.get(response_id)

    @router.get("/responses/{response_id}/input_items")
    async def input_items(response_id: str, order: Literal["asc", "desc"] = "desc",
                          limit: Annotated[int, Query(ge=1, le=100)] = 20,
                          after: str | None = None) -> dict[str, Any]:
        return store.input_items(response_id, order=order, limit=limit, after=after)

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


async def chat_chunks(body: AsyncIterable[Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a chat completion's SSE stream (up to ``[DONE]``)."""
    buf = b""
    async for piece in body:
        buf += piece if isinstance(piece, bytes) else str(piece).encode()
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                return
            yield json.loads(data)


def add_tool_calls(calls: dict[int, dict[str, str]], delta: dict[str, Any]) -> None:
    """Fold a chat delta's ``tool_calls`` pieces into ``calls`` (by index: id, name, arguments)."""
    for tc in delta.get("tool_calls") or []:
        call = calls.setdefault(tc.get("index", 0), {"id": "", "name": "", "arguments": ""})
        fn = tc.get("function") or {}
        call["id"] = tc.get("id") or call["id"]
        call["name"] = fn.get("name") or call["name"]
        call["arguments"] += fn.get("arguments") or ""


class _Events:
    """One streamed response: the chat chunks in, the Responses events out."""

    def __init__(self, rid: str, req: ResponsesRequest, model: str, created: int,
                 store: ResponseStore, history: list[dict[str, Any]]) -> None:
        self.rid, self.req, self.model, self.created = rid, req, model, created
        self.store, self.history = store, history
        self.seq = 0
        self.msg_id = new_id("msg")

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, event=kind)

    def _response(self, status: str, output: list[dict[str, Any]] | None = None,
                  usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.rid, self.req, self.model, status=status, output=output or [],
                               usage_=usage_, created=self.created)

    def _text_start(self) -> list[bytes]:
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant",
                "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.msg_id, output_index=0,
                            content_index=0, part=part)]

    async def run(self, chat: AsyncIterable[Any]) -> AsyncIterator[bytes]:
        """The events; closing this closes ``chat`` (aborting its engine request)."""
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        text: list[str] = []
        logprobs: list[Any] = []
        calls: dict[int, dict[str, str]] = {}
        finish, chat_usage, started = None, None, False
        try:
            async for chunk in chat_chunks(chat):
                if "error" in chunk:  # the engine failed after the stream started
                    err = chunk["error"]
                    yield self._event("error", code=err.get("code"), message=err.get("message"),
                                      param=err.get("param"))
                    failed = self._response("failed")
                    failed["error"] = {"code": "server_error", "message": err.get("message")}
                    yield self._event("response.failed", response=failed)
                    return
                chat_usage = chunk.get("usage") or chat_usage
                for choice in chunk["choices"]:
                    delta = choice.get("delta") or {}
                    add_tool_calls(calls, delta)
                    if delta.get("content") and not delta.get("tool_calls"):
                        if not started:
                            for event in self._text_start():
                                yield event
                            started = True
                        piece = (choice.get("logprobs") or {}).get("content") or []
                        logprobs += piece
                        text.append(delta["content"])
                        yield self._event("response.output_text.delta", item_id=self.msg_id,
                                          output_index=0, content_index=0, delta=delta["content"],
                                          logprobs=piece)
                    finish = choice.get("finish_reason") or finish
        finally:
            aclose = getattr(chat, "aclose", None)
            if aclose is not None:
                await aclose()
        output: list[dict[str, Any]] = []
        if calls:
            for i, (_, c) in enumerate(sorted(calls.items())):
                item = {"type": "function_call", "id": new_id("fc"), "call_id": c["id"], "name": c["name"],
                        "arguments": "", "status": "in_progress"}
                yield self._event("response.output_item.added", output_index=i, item=item)
                yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=i, delta=c["arguments"])
                yield self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=i, arguments=c["arguments"])
                item = {**item, "arguments": c["arguments"], "status": "completed"}
                output.append(item)
                yield self._event("response.output_item.done", output_index=i, item=item)
        else:
            if not started:
                for event in self._text_start():
                    yield event
            part: dict[str, Any] = {"type": "output_text", "text": "".join(text), "annotations": [],
                                    "logprobs": logprobs}
            yield self._event("response.output_text.done", item_id=self.msg_id, output_index=0,
                              content_index=0, text=part["text"], logprobs=logprobs)
            yield self._event("response.content_part.done", item_id=self.msg_id, output_index=0,
                              content_index=0, part=part)
            message: dict[str, Any] = {"type": "message", "id": self.msg_id, "status": "completed",
                                       "role": "assistant", "content": [part]}
            output.append(message)
            yield self._event("response.output_item.done", output_index=0, item=message)
        status = finished_status(finish)
        final = self._response(status, output, usage(chat_usage))
        if self.req.store:
            self.store.put(final, self.history + assistant_turn(output), input_records(self.req.input))
        yield self._event("response.completed" if status == "completed" else "response.incomplete",
                          response=final)
