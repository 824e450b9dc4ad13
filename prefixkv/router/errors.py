"""OpenAI-style error bodies and answers for the router (the router imports nothing from the
server package, which has its own)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

__all__ = ["error_body", "error_response"]


def error_body(message: str, *, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, dict[str, str | None]]:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, *, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-style error answer with HTTP status ``status``."""
    return JSONResponse(error_body(message, type_=type_, param=param, code=code),
                        status_code=status)
