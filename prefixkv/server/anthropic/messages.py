"""Owns: the Messages request model and its translation to a chat completion and back.
Imports: the server core (bodies, errors, limits) only.

Anthropic's Messages API on the chat path: ``POST /v1/messages`` (and ``/v1/messages/count_tokens``).

Clients written for Anthropic's API (the ``anthropic`` SDK, agents that speak it) work
unchanged, as they do with vLLM's and SGLang's ``/v1/messages``. A request becomes a chat
completion: ``system`` (a string or text blocks) a system message first, ``messages`` with
string or block content (``text``; an assistant's ``tool_use`` blocks as its ``tool_calls``; a
user's ``tool_result`` blocks as ``tool`` messages), ``max_tokens`` (required),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``tools`` (``input_schema``) and
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``). The answer is a ``message``: ``content``
blocks (``text``; ``tool_use`` with the parsed ``input``), ``stop_reason`` (``end_turn``,
``max_tokens``, ``stop_sequence`` with ``stop_sequence``, ``tool_use``) and ``usage`` in
Anthropic's terms (``cache_read_input_tokens``, ``cache_creation_input_tokens`` at the
request's ``cache_control`` breakpoints, ``input_tokens`` the rest:
:mod:`prefixkv.server.anthropic.cache_control`, which also retains the breakpoints' prefixes for
their TTL). Streaming: :mod:`prefixkv.server.anthropic.messages_stream`.

Not implemented, a 400 naming the field: image and document blocks, ``thinking`` enabled,
server-side tools (``mcp_servers``, ``container``, and tools without an ``input_schema``).
``cache_control`` (on tools, system blocks, content blocks, and the request itself) is checked
as Anthropic checks it (``type`` ``"ephemeral"``, ``ttl`` ``"5m"`` or ``"1h"``).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from prefixkv.server.errors import APIError
from prefixkv.server.limits import MAX_MESSAGES
from prefixkv.server.bodies import PositiveInt, _Body

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
"""Chat ``finish_reason`` -> Anthropic ``stop_reason`` (``stop``: see :func:`stop_reason`)."""


class CacheControl(_Body):
    """A breakpoint: ``{"type": "ephemeral", "ttl": "5m" | "1h"}`` (``"5m"`` when absent)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class Block(_Body):
    """A content block: ``text``, ``tool_use`` or ``tool_result`` (others are refused)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    cache_control: CacheControl | None = None

    def plain(self) -> str:
        """A ``tool_result``'s content (or a text block's text) as one string."""
        if self.type == "text":
            return self.text or ""
        if isinstance(self.content, list):
            return "".join(b.plain() for b in self.content)
        return self.content or ""


class Message(_Body):
    """One turn: ``user`` or ``assistant``, a string or blocks."""

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    """``{"name", "description", "input_schema"}`` (a client tool)."""

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(_Body):
    """``{"type": "auto" | "any" | "tool" | "none", "name"}``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(_Body):
    """``POST /v1/messages``."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: PositiveInt
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    mcp_servers: Any = None
    container: Any = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    """vLLM's tenant key (requests with different salts never share cached KV)."""
    extra_key: Annotated[str, Field(min_length=1)] | None = None
    """SGLang's cache-isolation key (combined with ``cache_salt``)."""
    cache_control: CacheControl | None = None
    """Anthropic's automatic caching: a breakpoint after the whole conversation."""


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: the prompt part of a request."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    cache_control: CacheControl | None = None


def turns(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of a request (``APIError`` naming a block this server refuses)."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.plain() for b in req.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for j, b in enumerate(m.content):
            if b.type == "text":
                text.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                calls.append({"id": b.id or f"toolu_{uuid.uuid4().hex}", "type": "function",
                              "function": {"name": b.name or "", "arguments": json.dumps(b.input or {})}})
            elif b.type == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": b.tool_use_id or "", "content": b.plain()})
            else:
                raise APIError(f"a {b.type!r} block in a {m.role} message is not supported by this server",
                               param=f"messages[{i}].content[{j}]")
        if text or calls or m.role == "assistant":
            turn: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion request for ``req``."""
    if req.thinking is not None and req.thinking.get("type") == "enabled":
        raise APIError("extended thinking is not supported by this server", param="thinking")
    for name in ("mcp_servers", "container"):  # server-side tools: the answer would differ
        if getattr(req, name) is not None:
            raise APIError(f"{name} is not supported by this server", param=name)
    body: dict[str, Any] = {"model": req.model, "messages": turns(req), "max_tokens": req.max_tokens,
                            "stream": req.stream}
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    for name in ("temperature", "top_p", "top_k", "cache_salt", "extra_key"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError("tool_choice of type 'tool' needs a name", param="tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if req.stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def stop_reason(finish: str | None, matched: Any, called: bool = False) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat ``finish_reason`` and its ``stop_reason``
    (``called``: the answer holds tool calls, ``tool_use`` whichever way the call was forced)."""
    if finish is None:
        return None, None
    if called and finish in ("stop", "tool_calls"):
        return "tool_use", None
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's ``message`` as content blocks (text first, then any tool calls)."""
    blocks: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for c in calls:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": json.loads(c["function"]["arguments"] or "{}")})
    return blocks


def message_object(mid: str, model: str, content: list[dict[str, Any]], reason: tuple[str | None, str | None],
                   usage_: dict[str, Any]) -> dict[str, Any]:
    """The ``message`` object."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage_}


def count_body(req: CountTokensRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The chat messages and tools a count is taken over (the tools as the chat path gives
    them to the template, so the count is the prompt a request renders)."""
    return turns(req), chat_tools(req.tools) if req.tools else None


def chat_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Anthropic tools as chat ``tools`` (no ``description`` key when it has none, as the chat
    path's ``model_dump(exclude_none=True)`` hands them to the template)."""
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out
