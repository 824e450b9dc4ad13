"""Owns: how a route's JSON body is decoded: msgspec first, the standard library's ``json`` after.
Imports: FastAPI / Starlette and msgspec only.

FastAPI decodes a request body with ``json.loads`` on the event loop; a 10 MB prompt batch on
``/v1/completions`` or ``/generate`` held every other request for about 33 ms of that (msgspec:
3 ms, same body; ``prefixkv bench hostile``). :class:`FastJSONRoute` is an ``APIRoute`` whose
requests decode with ``msgspec.json.decode``; a body msgspec refuses (``NaN``, lone surrogates,
numbers out of float range, invalid JSON) is decoded again by ``json.loads``, so what a route
accepts and the errors it answers are exactly FastAPI's. Decoding on a thread does not help: the
GIL is held for the whole document either way (docs/reliability.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["FastJSONRequest", "FastJSONRoute", "decode"]

_decoder = msgspec.json.Decoder()


def decode(body: bytes) -> Any:
    """``body`` as ``json.loads`` reads it, decoded by msgspec when it can."""
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError:  # NaN, lone surrogates, 1e400, bad JSON: json's answer
        return json.loads(body)


class FastJSONRequest(Request):
    """A request whose :meth:`json` is :func:`decode` of its body (cached, as Starlette's)."""

    async def json(self) -> Any:
        """The decoded body."""
        if not hasattr(self, "_json"):
            self._json = decode(await self.body())
        return self._json


class FastJSONRoute(APIRoute):
    """An ``APIRoute`` handing its endpoint a :class:`FastJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, given the request as a :class:`FastJSONRequest`."""
        handler = super().get_route_handler()

        async def fast_json_handler(request: Request) -> Response:
            return await handler(FastJSONRequest(request.scope, request.receive))

        return fast_json_handler
