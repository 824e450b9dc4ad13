"""Owns: OpenAI-style error bodies (every dialect answers errors this way) and their handlers.
Imports: FastAPI and pydantic only.

OpenAI-style error bodies and the handlers that turn every failure into one.

Every error the server returns has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": int | str | None}}``.
Status codes: 400 bad request (invalid JSON, wrong or unknown fields, values out of range, a
prompt too long for the context or the KV pool), 401 missing or wrong API key, 403 an admin
route without admin rights, 404 unknown model or route, 405 wrong method, 413 a body over
``--max-request-body-bytes``, 500 a request that failed on its own (the server keeps serving;
the response carries ``X-Prefixkv-Error-Cause: request``), 503 the engine cannot take the
request (not running, or no KV room it could ever free).

A router must not retry a 4xx, nor a 5xx carrying ``ERROR_CAUSE_HEADER: request``: the same
request would fail the same way on every worker. Other 5xx and connection failures are the
worker's, and worth retrying elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

ERROR_CAUSE_HEADER = "X-Prefixkv-Error-Cause"
"""Set to ``"request"`` on a 5xx caused by the request itself (do not retry it elsewhere)."""
MAX_ERROR_MESSAGE_CHARS = 2048
"""Longest error message sent (longer ones are cut: an error never echoes a whole request)."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to report to the client with status ``status`` (OpenAI-style body)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: int | str | None = None,
        type: str | None = None,
        request_caused: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code if code is not None else status
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.request_caused = request_caused

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        """The error as a JSON response."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.request_caused:
            headers[ERROR_CAUSE_HEADER] = "request"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def nested_too_deeply(exc: RecursionError, param: str | None = None) -> APIError:
    """The 400 for a ``RecursionError``: the request's content nests too deeply to process (a
    client error, never a fault of the server, which goes on serving)."""
    return APIError(f"the request nests too deeply to process ({exc})", param=param,
                    code="nested_too_deeply", request_caused=True)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None,
    code: int | str | None = 400,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``; a message (which may echo the
    request's values) longer than :data:`MAX_ERROR_MESSAGE_CHARS` is cut there, so every error
    body stays small whatever the request held."""
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS - 32] + f"... ({len(message):,} characters)"
    if param is not None and len(param) > 256:
        param = param[:256]
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    parts = list(loc[1:]) if loc and loc[0] in ("body", "query", "path") else list(loc)
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


# Pydantic reports a value that fits no branch of a union once per branch, with the branch's
# type name appended to the location; these say what the field accepts instead.
_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids, or a list of either",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}


def _strip_union_branch(errors: list[Any]) -> tuple[tuple[Any, ...], str | None]:
    """If the first error is one branch of a failed union, return the union's location and a
    hint; else the first error's location and ``None``."""
    loc = tuple(errors[0].get("loc", ()))
    for cut in range(len(loc) - 1, 0, -1):
        part = loc[cut]
        if not isinstance(part, str) or part.isidentifier() and part not in (
                "str", "int", "float", "list", "dict"):
            continue
        base = loc[:cut]
        field = next((p for p in reversed(base) if isinstance(p, str)), "")
        return base, _UNION_HINTS.get(field, "has an invalid type or value")
    return loc, None


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn FastAPI/pydantic validation errors into one 400 naming the first bad field."""
    errors = list(exc.errors())
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(f"invalid JSON body: {detail}".rstrip(": "), code="invalid_json")
    loc, hint = _strip_union_branch(errors)
    param = _loc_to_param(loc)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        msg = "request body must be a JSON object"
    elif kind == "extra_forbidden":
        msg = f"unsupported field {param!r}"
    elif kind == "missing" and param is None:
        msg = "request body is required: a JSON object"
    elif kind == "missing":
        msg = f"missing required field {param!r}"
    elif hint is not None:
        msg = f"{param} {hint}"
    elif param and not msg.startswith(param.split(".")[-1].split("[")[0]):
        msg = f"{param}: {msg}"
    return APIError(msg, param=param, code=kind or None)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Register handlers so every error leaves the server as an OpenAI-style body;
    ``on_error(status)`` is called for each (metrics)."""

    def respond(err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        return err.response()

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return respond(exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        code = "request_too_large" if exc.status_code == 413 else None  # as every 413's
        return respond(APIError(message, status=exc.status_code, code=code))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RecursionError):  # only a request's own nesting recurses that deep
            return respond(nested_too_deeply(exc))
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(APIError(f"internal error: {exc}", status=500))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
