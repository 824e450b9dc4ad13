"""Owns: ``ServerLimits`` (what one request may ask) and the 413 body-size middleware.
Imports: errors.py only.

What one request may ask of the server: body size, samples, prompts, default lengths.

``ServerLimits`` is built once (``prefixkv serve`` flags) and handed to ``create_app``;
``BodySizeLimit`` is the ASGI middleware that enforces ``max_body_bytes`` before the body is
parsed: a declared ``Content-Length`` over the limit is answered 413 without reading the
body, and a chunked body is cut off (413) as soon as it passes the limit.
:func:`check_prompt_chars` is the length guard every prompt-taking route runs on the raw text
of its prompt fields before any templating, tokenizing or re-encoding.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel

from prefixkv.server.errors import APIError, error_body

Scope = dict[str, Any]
ASGIApp = Any


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-request caps; ``ValueError`` naming the field for a bad value.

    Attributes:
        max_body_bytes: largest request body (413 above it).
        max_n: most samples (``n``) one request may ask for.
        max_prompts: most prompts in one ``/v1/completions`` batch.
        default_chat_max_tokens: a chat request without ``max_tokens`` generates at most this
            many tokens (and never more than the room left in the context or the pool), like
            SGLang's default ``max_new_tokens``; completions default to OpenAI's 16.
        max_retention_priority: the highest retention priority a request's ``priority`` field
            reaches (0-100; 0: the field retains nothing; ``server/retention.py``).
        otlp_traces_endpoint: where each request's OpenTelemetry span goes (an OTLP/HTTP URL,
            vLLM's ``--otlp-traces-endpoint``; ``server/tracing.py``); ``None``: no tracing.
    """

    max_body_bytes: int = 16 << 20
    max_n: int = 64
    max_prompts: int = 256
    default_chat_max_tokens: int = 1024
    max_retention_priority: int = 50
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_prompts", "default_chat_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        cap = self.max_retention_priority
        if not isinstance(cap, int) or isinstance(cap, bool) or not 0 <= cap <= 100:
            raise ValueError(f"max_retention_priority must be an int in [0, 100], got {cap!r}")
        url = self.otlp_traces_endpoint
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL (OTLP/HTTP, "
                             f"e.g. http://127.0.0.1:4318/v1/traces), got {url!r}")


def declared_length(scope: Scope) -> int | None:
    """A request's ``Content-Length`` (``None`` when absent or malformed: the body's own bytes
    are counted then, see :func:`capped_receive`)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def capped_receive(receive: Any, cap: int,
                   too_large: Callable[[], Exception]) -> Callable[[], Awaitable[dict[str, Any]]]:
    """``receive`` that raises ``too_large()`` once more than ``cap`` body bytes arrived (a
    chunked body, or one longer than it said)."""
    seen = 0

    async def capped() -> dict[str, Any]:
        nonlocal seen
        message: dict[str, Any] = await receive()
        if message.get("type") == "http.request":
            seen += len(message.get("body", b""))
            if seen > cap:
                raise too_large()
        return message

    return capped


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes the limit (answered 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the {limit}-byte limit (--max-request-body-bytes)")


class BodySizeLimit:
    """ASGI middleware: 413 with an OpenAI-style body for bodies over ``limit`` bytes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.limit:
            await self._reject(send)
            return
        await self.app(scope, capped_receive(receive, self.limit,
                                             lambda: BodyTooLarge(self.limit)), send)

    async def _reject(self, send: Any) -> None:
        body = json.dumps(error_body(
            f"request body exceeds the {self.limit}-byte limit (--max-request-body-bytes)",
            type="invalid_request_error", code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


MAX_MESSAGES = 4096
"""Most messages (or Responses ``input`` items) one request may hold: pydantic validates the
body on the event loop before any route code runs, ~40 us a message, so 100k tiny messages
(a 13 MB body) held every client for 1.5 s; past the cap validation stops at once (a 400)."""

PROMPT_CHARS_PER_TOKEN = 32
"""Characters one token may cover in the length guard: far above any tokenizer's average (3-5
for text, rarely over 16 even for runs of spaces), so a prompt that could fit the context is
never refused by the guard; what passes it is still checked exactly after tokenizing."""


def check_prompt_chars(max_model_len: int, fields: Mapping[str, Any]) -> None:
    """The length guard: :class:`APIError` (400) naming the largest of ``fields`` (``{name:
    value}``, values as parsed: strings, lists, dicts, pydantic models) when their text holds
    more than ``max_model_len * PROMPT_CHARS_PER_TOKEN`` characters together: such a prompt can
    never fit the context, and refusing it costs one walk over the parsed body, not seconds of
    templating and tokenizing (issue 40: 10 MB bodies held the server for 16-56 s). Then a
    400 naming the field if its text is not valid Unicode (a lone surrogate such as
    ``"\\ud800"``, which the tokenizer cannot encode)."""
    limit = max_model_len * PROMPT_CHARS_PER_TOKEN
    sizes = {name: text_chars(value, limit + 1) for name, value in fields.items()}
    if sum(sizes.values()) > limit:
        name = max(sizes, key=lambda n: sizes[n])
        raise APIError(
            f"{name} holds over {limit:,} characters: far more than the model's context of "
            f"{max_model_len:,} tokens can hold", param=name, code="context_length_exceeded")
    for name, value in fields.items():
        for text in _strings(value):
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise APIError(f"{name} is not valid Unicode: {exc.reason} at character "
                                   f"{exc.start} of a string", param=name) from None


def text_chars(value: Any, stop_after: int) -> int:
    """The characters of every string inside ``value`` (dict keys too), counted until the count
    passes ``stop_after`` (then the count so far)."""
    total = 0
    for text in _strings(value):
        total += len(text)
        if total > stop_after:
            break
    return total


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (dict keys too); iterative, so any nesting is fine."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, BaseModel):
            stack.extend(getattr(item, name) for name in type(item).model_fields)
            stack.extend((item.model_extra or {}).values())
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
