"""Owns: the Responses request model and its translation to a chat completion and back.
Imports: the server core (bodies, errors, limits) only.

OpenAI's Responses API on the chat path: ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}``.

A request is translated into a chat completion (``instructions`` a system message first,
``input`` a string or message / ``function_call`` / ``function_call_output`` items, ``text.format``
the ``response_format``, ``tools`` and ``tool_choice``, ``max_output_tokens``) and run by
:class:`~prefixkv.server.openai.serving.OpenAIServing` (its limits, metrics and client-gone aborts);
its answer becomes a ``response`` object: ``output`` items (an assistant ``message`` with
``output_text``, or ``function_call`` items), ``status`` (``incomplete`` with
``incomplete_details.reason = "max_output_tokens"`` when cut), ``usage`` with
``input_tokens_details.cached_tokens``. Streaming emits the Responses events
(:mod:`prefixkv.server.openai.responses_stream`).

Conversation state: a response is stored (``store``, default true) with the conversation it
ended, in memory (:mod:`prefixkv.server.openai.responses_store`); ``previous_response_id`` continues it (the
earlier turns render to the same prompt prefix, so they are read from the prefix cache).
``instructions`` are not carried over (OpenAI's rule). Not implemented, a 400 naming the field:
``background``, ``truncation: "auto"``, ``conversation`` and ``prompt`` (server-side objects),
hosted tools (anything but ``function``). ``reasoning`` is accepted and has no effect (no
reasoning parser: a reasoning model's thoughts stay in the text).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, ValidationError

from prefixkv.server.errors import APIError
from prefixkv.server.limits import MAX_MESSAGES
from prefixkv.server.bodies import NumLogprobs, PositiveInt, _Body

RESPONSE_ID_HEADER = "x-prefixkv-response-id"
"""Set on a stored response's answer (JSON or stream): the router sends a request continuing it
(``previous_response_id``) to the worker that holds it."""

_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
           "top_logprobs": "top_logprobs", "tools": "tools", "tool_choice": "tool_choice"}
"""The chat field an error names -> the Responses field it came from."""


class ContentPart(_Body):
    """A text part of a message (``input_text``; an earlier answer's ``output_text``)."""

    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class MessageItem(_Body):
    """An input message (``developer`` is the system role here)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    """A call the model made in an earlier turn (sent back with its output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(_Body):
    """``{"type": "function", "name", "description", "parameters", "strict"}``."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Body):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None


class TextConfig(_Body):
    """``text``: the output's format."""

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(_Body):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | Annotated[list[MessageItem | FunctionCallItem | FunctionCallOutputItem],
                           Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: NumLogprobs | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    """OpenAI's: ``"24h"`` retains the request's cached prefix a day (``server/retention.py``)."""
    priority: Annotated[int, Field(strict=True)] | None = None
    """vLLM's: above 0, the retention priority of what the request caches (capped)."""
    reasoning: dict[str, Any] | None = None
    background: StrictBool = False
    truncation: Literal["disabled", "auto"] | None = None
    conversation: Any = None
    prompt: Any = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    """vLLM's tenant key (requests with different salts never share cached KV)."""
    extra_key: Annotated[str, Field(min_length=1)] | None = None
    """SGLang's cache-isolation key (combined with ``cache_salt``)."""

    def refused(self) -> tuple[str, str] | None:
        """``(param, message)`` for a setting this server does not implement."""
        if self.background:
            return "background", "background responses are not supported by this server"
        for name in ("conversation", "prompt"):  # server-side state this server does not keep
            if getattr(self, name) is not None:
                return name, f"{name} is not supported by this server (send the input itself, or previous_response_id)"
        if self.truncation == "auto":
            return "truncation", "truncation 'auto' is not supported by this server (use 'disabled')"
        return None


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages (calls as assistant ``tool_calls``, outputs as ``tool``)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request for ``req`` after the conversation ``history``."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "max_tokens": req.max_output_tokens}
    for name in ("temperature", "top_p", "user", "cache_salt", "extra_key", "prompt_cache_key",
                 "prompt_cache_retention", "priority"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or []):
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def chat_error(exc: APIError | ValidationError) -> APIError:
    """A chat-path error re-addressed to the Responses field it came from."""
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        return APIError(f"{loc}: {err['msg']}", param=_responses_param(loc))
    if exc.param is not None:
        exc.param = _responses_param(exc.param)
    return exc


def _responses_param(chat_param: str) -> str:
    """The Responses field a chat field path came from (``messages[2].content`` -> ``input``:
    the chat messages' indices are not the input items')."""
    head = re.match(r"\w+", chat_param)
    return _PARAMS.get(head.group(0), chat_param) if head else chat_param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict[str, Any], logprobs: list[Any] | None) -> list[dict[str, Any]]:
    """A chat answer's ``message`` as Responses ``output`` items."""
    calls = message.get("tool_calls") or []
    if calls:
        return [{"type": "function_call", "id": new_id("fc"), "call_id": c["id"],
                 "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                 "status": "completed"} for c in calls]
    part = {"type": "output_text", "text": message.get("content") or "", "annotations": [],
            "logprobs": logprobs or []}
    return [{"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
             "content": [part]}]


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat ``usage`` in the Responses shape."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": chat_usage["total_tokens"]}


def response_object(rid: str, req: ResponsesRequest, model: str, *, status: str,
                    output: list[dict[str, Any]], usage_: dict[str, Any] | None,
                    created: int) -> dict[str, Any]:
    """The ``response`` object (echoing the request's settings, as OpenAI's does)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}
    tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": model, "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt}, "tool_choice": tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
        "usage": usage_, "user": req.user, "metadata": req.metadata or {},
    }


def finished_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def assistant_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's ``output`` as the chat messages a later turn continues from."""
    calls = [{"id": o["call_id"], "type": "function",
              "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in output if o["type"] == "function_call"]
    if calls:
        return [{"role": "assistant", "content": "", "tool_calls": calls}]
    text = "".join(p["text"] for o in output if o["type"] == "message" for p in o["content"])
    return [{"role": "assistant", "content": text}]


def now() -> int:
    return int(time.time())
