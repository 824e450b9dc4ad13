"""Responses API conversations behind the router: which worker holds each stored response.

A worker that stores a Responses API answer names its id in a header
(:data:`RESPONSE_ID_HEADER`); only that worker holds the conversation (elsewhere the id is a
404). :class:`StoredResponses` remembers id -> worker for the newest :data:`MAX_REMEMBERED`
answers, so a request continuing one (``previous_response_id``) and ``GET`` / ``DELETE
/v1/responses/{id}`` go to its worker. Owned by :class:`~prefixkv.router.proxy.Router`, used on
its event loop only. Imports httpx and the router's error bodies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping

import httpx
from fastapi.responses import Response

from prefixkv.router.errors import error_response

RESPONSE_ID_HEADER = "x-prefixkv-response-id"
"""A worker's stored Responses API answer names its id here (``prefixkv.server.openai.responses``)."""
MAX_REMEMBERED = 65536
"""Stored responses whose worker the router remembers (the oldest forgotten first)."""


class StoredResponses:
    """Stored response id -> the worker that answered it, the newest ``limit`` kept."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self.limit = limit
        self._holder: OrderedDict[str, str] = OrderedDict()

    def holder(self, response_id: str | None) -> str | None:
        """The worker holding ``response_id`` (``None`` when unknown or not given)."""
        return None if response_id is None else self._holder.get(response_id)

    def remember(self, headers: Mapping[str, str], status: int, url: str) -> None:
        """Record the stored response a successful answer from ``url`` announces, if any."""
        rid = headers.get(RESPONSE_ID_HEADER)
        if rid is not None and status < 400:
            self._holder[rid] = url
            while len(self._holder) > self.limit:
                self._holder.popitem(last=False)

    async def forward(self, client: httpx.AsyncClient, healthy: Collection[str], method: str,
                      response_id: str, headers: Mapping[str, str], rest: str = "") -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}`` (``rest``: what follows the id, e.g.
        ``/input_items?limit=5``) from the worker holding it (a 404 when no worker answered
        it through this router, or it is not in ``healthy``; 502 when it fails)."""
        url = self._holder.get(response_id)
        if url is None or url not in healthy:
            return error_response(404, f"no stored response with id {response_id!r} on a healthy worker",
                                  type_="not_found_error", code="response_not_found")
        try:
            resp = await client.request(method, f"{url}/v1/responses/{response_id}{rest}",
                                        headers=dict(headers))
        except httpx.HTTPError as exc:
            return error_response(502, f"worker {url} failed: {exc}", type_="worker_error",
                                  code="worker_failed")
        if method == "DELETE" and not rest and resp.status_code == 200:
            self._holder.pop(response_id, None)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))
