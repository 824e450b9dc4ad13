"""Owns: the stored responses behind ``previous_response_id`` and ``GET /v1/responses/{id}``.
Imports: errors.py and responses.py.

Stored Responses API responses: what ``previous_response_id`` continues and ``GET
/v1/responses/{id}`` (``/input_items``) read, in memory, the latest :data:`MAX_STORED`."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from prefixkv.server.errors import APIError
from prefixkv.server.openai.responses import FunctionCallItem, MessageItem, new_id

MAX_STORED = 1024
"""Stored responses kept (the oldest is dropped first)."""


def input_records(items: str | list[Any]) -> list[dict[str, Any]]:
    """A request's ``input`` as OpenAI's stored input items (each with an id and a status)."""
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            kind = "output_text" if item.role == "assistant" else "input_text"
            part: dict[str, Any] = {"type": kind, "text": item.text()}
            if kind == "output_text":
                part["annotations"] = []
            out.append({"id": new_id("msg"), "type": "message", "role": item.role,
                        "status": "completed", "content": [part]})
        elif isinstance(item, FunctionCallItem):
            out.append({"id": new_id("fc"), "type": "function_call", "call_id": item.call_id,
                        "name": item.name, "arguments": item.arguments, "status": "completed"})
        else:
            out.append({"id": new_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                        "output": item.output, "status": "completed"})
    return out


class ResponseStore:
    """Stored responses and the conversation each ended (most recent :data:`MAX_STORED`)."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]] = \
            OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            inputs: list[dict[str, Any]] | None = None) -> None:
        """Keep ``response``, the chat ``conversation`` it ended and its ``inputs`` records."""
        self._items[response["id"]] = (response, conversation, inputs or [])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> dict[str, Any]:
        """The stored response ``rid`` (a 404 naming it if unknown or dropped)."""
        return self._entry(rid)[0]

    def conversation(self, rid: str) -> list[dict[str, Any]]:
        """The messages response ``rid`` ended, its answer included (a 404 if unknown)."""
        return list(self._entry(rid, param="previous_response_id")[1])

    def input_items(self, rid: str, *, order: str = "desc", limit: int = 20,
                    after: str | None = None) -> dict[str, Any]:
        """A page of response ``rid``'s input items, OpenAI's list shape (``desc``: newest
        first; ``after``: the id the page starts after)."""
        items = list(self._entry(rid)[2])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise APIError(f"no input item {after!r} in response {rid!r}", status=404, param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def delete(self, rid: str) -> None:
        self._entry(rid)
        del self._items[rid]

    def _entry(self, rid: str, param: str = "response_id"
               ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
        entry = self._items.get(rid)
        if entry is None:
            raise APIError(f"no stored response with id {rid!r} (responses are kept in memory, "
                           f"the latest {self.capacity})", status=404, param=param)
        return entry


