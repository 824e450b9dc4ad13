"""Owns: the engine-backed answer every dialect shares: the SSE writer and its aborting stream.
Imports: prefixkv.engine's outputs and errors.py; no dialect (every dialect imports this).

:class:`EngineStreamingResponse` aborts its engine requests the moment the client goes away,
:func:`finish_unless_gone` does the same for a whole (non-streamed) reply, and
:func:`engine_failure` is the HTTP error for an engine failure (a request-caused 500, a 503 for
KV room or a stopped engine).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse

from prefixkv.engine.outputs import RequestFailedError
from prefixkv.server.errors import APIError, nested_too_deeply

Disconnected = Callable[[], Awaitable[bool]]
"""``await is_disconnected()``: whether the HTTP client has gone away."""

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming request checks for a client that went away."""


def engine_failure(exc: BaseException) -> APIError:
    """The HTTP error for a request the engine failed or could not take."""
    if isinstance(exc, RecursionError):  # raised by the request's own content, not a fault
        return nested_too_deeply(exc)
    if isinstance(exc, RequestFailedError):
        if exc.request_caused:
            return APIError(f"the request failed: {exc}", status=500, code="request_failed",
                            request_caused=True)
        return APIError(str(exc), status=503, code="insufficient_kv_capacity")
    return APIError(f"the engine is not running: {exc}", status=503, code="engine_unavailable")


T = TypeVar("T")


async def finish_unless_gone(task: asyncio.Future[T], is_disconnected: Disconnected) -> T:
    """``task``'s result for a non-streaming reply; a client that goes away first (noticed
    between polls) has it cancelled and gets a 499; an engine failure (``RuntimeError``:
    ``RequestFailedError`` or the engine stopped) is :func:`engine_failure`'s error. The task
    is done when this returns or raises."""
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await is_disconnected():
                raise APIError("client disconnected", status=499, code="client_closed")
        try:
            return task.result()
        except RuntimeError as exc:
            raise engine_failure(exc) from exc
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that closes its body generator the moment the client goes away.

    Starlette leaves an abandoned body generator to the garbage collector (and notices a
    disconnect only at the next write), so the engine requests behind a cut stream could run
    on for seconds. Here a listener waits for ``http.disconnect`` beside the writer, and the
    generator is closed on every exit, which aborts its unfinished engine requests at once.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        writer = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, listener):
                task.cancel()
            await asyncio.gather(writer, listener, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if not writer.cancelled() and isinstance(writer.exception(), Exception) and not (
                isinstance(writer.exception(), OSError)):
            raise writer.exception()  # type: ignore[misc]


def sse(obj: dict[str, Any] | list[Any] | str, event: str | None = None) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``, after ``event: <event>`` when named."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()
