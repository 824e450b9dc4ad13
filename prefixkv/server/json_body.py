"""Owns: how a route's JSON body is decoded: msgspec first, the standard library's ``json`` after.
Imports: FastAPI / Starlette, msgspec, errors.py and ``engine.sampling_params``'s bias bound.

FastAPI decodes a request body with ``json.loads`` on the event loop; a 10 MB prompt batch on
``/v1/completions`` or ``/generate`` held every other request for about 33 ms of that (msgspec:
3 ms, same body; ``prefixkv bench hostile``). :class:`FastJSONRoute` is an ``APIRoute`` whose
requests decode with ``msgspec.json.decode``; a body msgspec refuses (``NaN``, lone surrogates,
numbers out of float range, invalid JSON) is decoded again by ``json.loads``, so what a route
accepts and the errors it answers are exactly FastAPI's. Decoding on a thread does not help: the
GIL is held for the whole document either way (docs/reliability.md).

Before decoding, :func:`check_logit_bias_bytes` reads such a body's top-level fields as raw JSON
(msgspec skips over each value without building it: 0.9 ms for a 1.4 MB body) and refuses a
``logit_bias`` (OpenAI's, or SGLang's inside ``sampling_params``) longer than
:data:`MAX_LOGIT_BIAS_JSON_BYTES`: more than the 1,024 entries it may hold can take, so building
its dict (13 ms on the event loop for 100k entries, every other client waiting) is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from prefixkv.engine.sampling_params import MAX_LOGIT_BIAS_TOKENS
from prefixkv.server.errors import APIError

__all__ = ["MAX_LOGIT_BIAS_JSON_BYTES", "FastJSONRequest", "FastJSONRoute",
           "check_logit_bias_bytes", "decode"]

_decoder = msgspec.json.Decoder()
_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])  # an object's values left undecoded

MAX_LOGIT_BIAS_JSON_BYTES = 256 * MAX_LOGIT_BIAS_TOKENS
"""The most bytes of JSON a ``logit_bias`` within its bound takes: 256 an entry (a token id and
a bias take 10-40, pretty-printed included), 256 KiB in all."""


def check_logit_bias_bytes(body: bytes) -> None:
    """:class:`APIError` (400 naming the field) when ``body`` is a JSON object whose
    ``logit_bias`` or ``sampling_params.logit_bias`` is longer than
    :data:`MAX_LOGIT_BIAS_JSON_BYTES`; nothing for any other body (:func:`decode` answers it)."""
    if len(body) <= MAX_LOGIT_BIAS_JSON_BYTES:
        return
    try:
        top = _fields.decode(body)
    except msgspec.DecodeError:  # not an object, or what only json reads: decode() answers
        return
    found = [("logit_bias", top.get("logit_bias"))]
    params = top.get("sampling_params")
    if params is not None and len(params) > MAX_LOGIT_BIAS_JSON_BYTES:
        try:
            found.append(("sampling_params.logit_bias", _fields.decode(params).get("logit_bias")))
        except msgspec.DecodeError:
            pass
    for name, raw in found:
        if raw is not None and len(raw) > MAX_LOGIT_BIAS_JSON_BYTES:
            raise APIError(
                f"logit_bias holds at most {MAX_LOGIT_BIAS_TOKENS} entries: its {len(raw):,} "
                f"bytes of JSON are more than that many take (at most "
                f"{MAX_LOGIT_BIAS_JSON_BYTES:,}), so it was not read", param=name)


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
    """An ``APIRoute`` handing its endpoint a :class:`FastJSONRequest`, after
    :func:`check_logit_bias_bytes` of a POST body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, given the request as a :class:`FastJSONRequest`."""
        handler = super().get_route_handler()

        async def fast_json_handler(request: Request) -> Response:
            fast = FastJSONRequest(request.scope, request.receive)
            if request.method == "POST":  # here, not in json(): FastAPI recasts errors there
                check_logit_bias_bytes(await fast.body())
            return await handler(fast)

        return fast_json_handler
