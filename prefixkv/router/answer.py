"""What the router answers on its proxied routes, and how that goes out over raw ASGI.

Contract. An :class:`Answer` is a status, headers and either a whole ``body`` or a ``stream`` of
byte pieces. A streamed answer owns resources (the worker's connection and in-flight count):
``close`` releases them and must be called once the answer is sent or abandoned, whether or not
the stream was ever iterated (:func:`send_answer` does it). Pieces are sent as they come (the
ASGI server frames them; nothing is joined or re-split here).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from prefixkv.router.errors import error_body

__all__ = ["Answer", "error_answer", "send_answer"]

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass(slots=True)
class Answer:
    """One answer: ``body`` unless ``stream`` is set (then ``close`` releases what it holds)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], None] | None = None


def error_answer(status: int, message: str, *, type_: str, param: str | None = None,
                 code: str | None = None) -> Answer:
    """An OpenAI-style error answer with HTTP status ``status``."""
    body = json.dumps(error_body(message, type_=type_, param=param, code=code)).encode()
    return Answer(status, {"content-type": "application/json"}, body)


async def send_answer(send: Send, answer: Answer) -> None:
    """Send ``answer`` over ASGI ``send``; a stream is closed (``close`` called) in any case."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()]
    if answer.stream is None:
        headers.append((b"content-length", str(len(answer.body)).encode()))
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer.body})
        return
    try:
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        async for piece in answer.stream:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        aclose = getattr(answer.stream, "aclose", None)
        if aclose is not None:
            await aclose()
        if answer.close is not None:
            answer.close()
