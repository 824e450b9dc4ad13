"""Owns: the per-route body cap of the routes that take one prompt (413 before any parsing).
Imports: limits.py (``PROMPT_CHARS_PER_TOKEN``), string_guard.py, errors.py.

A route whose body holds one prompt (chat, ``/v1/messages``, ``count_tokens``, ``/v1/responses``,
``/tokenize``, the chat render) can never need more bytes than that prompt's text at its most
escaped, plus room for the other fields: the length guard (``limits.check_prompt_chars``)
refuses more than ``max_model_len * PROMPT_CHARS_PER_TOKEN`` characters of prompt anyway, and
a character takes at most 12 bytes of JSON (``\\ud83d\\ude00``). So a body over
``max_model_len * 32 * 12 + FIELD_ALLOWANCE`` bytes (7.1 MiB at an 8,192-token context) is
answered 413 from its ``Content-Length``, before a byte of it is read, parsed or validated, and
a chunked one is cut off as soon as it passes the cap.

Why not parse big bodies on a worker thread: CPython's JSON decoders (``json``, ``orjson``,
``msgspec``) hold the GIL for a whole document, so a 10 MB body parsed on another thread still
stalls the event loop and the engine thread as long (measured: a 1 ms ticker's worst lag is the
same either way, docs/reliability.md). Not reading it is what frees the others.

``/v1/completions`` and ``/generate`` take batches of prompts (``--max-prompts-per-request``),
so their total bound is ``--max-request-body-bytes`` alone (``limits.BodySizeLimit``); their
body is cut (413) as soon as it provably holds one string longer than any field could be
(``string_guard.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from starlette.exceptions import HTTPException

from prefixkv.server.errors import error_body
from prefixkv.server.limits import PROMPT_CHARS_PER_TOKEN, capped_receive, declared_length
from prefixkv.server.string_guard import (
    BATCH_ROUTES,
    LongString,
    LongStringTooLarge,
    StringScan,
    guarded_receive,
    string_char_limit,
)

ONE_PROMPT_ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                     "/v1/responses", "/tokenize", "/v1/chat/completions/render")
"""The POST routes whose body holds one prompt (messages, input or prompt)."""

JSON_BYTES_PER_CHAR = 12
"""The most bytes one character takes in JSON: an escaped surrogate pair."""

FIELD_ALLOWANCE = 4 << 20
"""Room for every field that is not prompt text (``stop``: 64 strings of 4,096 characters, a
256 KiB JSON schema, ``logit_bias``, tools' framing, ...): generous, so no valid request is
refused."""


def prompt_body_cap(max_model_len: int, max_body_bytes: int) -> int:
    """The most bytes a one-prompt route's body may have for a model of ``max_model_len``
    tokens: never more than ``max_body_bytes`` (``--max-request-body-bytes``)."""
    prompt = max_model_len * PROMPT_CHARS_PER_TOKEN * JSON_BYTES_PER_CHAR
    return min(max_body_bytes, prompt + FIELD_ALLOWANCE)


class PromptBodyTooLarge(HTTPException):
    """Raised from ``receive`` when a chunked body passes its route's cap (answered 413)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


class PromptBodyLimit:
    """ASGI middleware: 413 with an OpenAI-style body for a one-prompt route's body over its
    cap (:func:`prompt_body_cap`), decided from ``Content-Length`` before the body is read; and
    for a batch route's body as soon as it holds a string over
    :func:`~prefixkv.server.string_guard.string_char_limit` (``string_guard.py``)."""

    def __init__(self, app: Any, max_model_len: int, max_body_bytes: int,
                 routes: Iterable[str] = ONE_PROMPT_ROUTES,
                 batch_routes: Iterable[str] = BATCH_ROUTES) -> None:
        self.app = app
        self.cap = prompt_body_cap(max_model_len, max_body_bytes)
        self.max_model_len = max_model_len
        self.routes = frozenset(routes)
        self.batch_routes = frozenset(batch_routes)
        self.string_limit = string_char_limit(max_model_len)

    def message(self, path: str, size: int | None) -> str:
        """Why a body is refused: its size, the cap and where the cap comes from."""
        got = f"of {size:,} bytes " if size is not None else ""
        return (f"request body {got}is over the {self.cap:,}-byte limit of POST {path}: its "
                f"prompt can hold at most {self.max_model_len * PROMPT_CHARS_PER_TOKEN:,} "
                f"characters (the model's {self.max_model_len:,}-token context), so it was not "
                f"read")

    def long_string_message(self, path: str, found: LongString) -> str:
        """Why a batch route's body is cut: the string, the limit and where it comes from."""
        return (f"request body of POST {path} holds a JSON string of at least {found.chars:,} "
                f"characters (seen by byte {found.at:,}), over the {self.string_limit:,}-"
                f"character limit of any one string: a prompt can hold at most "
                f"{self.max_model_len * PROMPT_CHARS_PER_TOKEN:,} characters (the model's "
                f"{self.max_model_len:,}-token context) and no other field comes near, so the "
                f"rest of the body was not read")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if path in self.batch_routes:
            await self.app(scope, guarded_receive(
                receive, StringScan(self.string_limit),
                lambda found: LongStringTooLarge(self.long_string_message(path, found))), send)
            return
        if path not in self.routes:
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.cap:
            await self._reject(send, self.message(path, declared))
            return
        await self.app(scope, capped_receive(receive, self.cap,
                                             lambda: PromptBodyTooLarge(self.message(path, None))),
                       send)

    @staticmethod
    async def _reject(send: Any, message: str) -> None:
        body = json.dumps(error_body(message, type="invalid_request_error",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
