"""The router's fan-out answer: one row per worker, and reading an answer as a server's or a router's.

``prefixkv route`` answers an admin call (``/v1/cache/*``) with every worker's answer::

    {"object": "list", "data": [{"worker": url, "status": 200, "body": {...}}, ...]}

The router builds its rows with :func:`worker_row`; its clients (``prefixkv cache``,
``prefixkv bench load``) tell such an answer from a server's own with :func:`worker_rows`. A
server's own list answers (``/v1/cache/pinned``) have rows without ``worker``, so they are not
taken for a fan-out. This module imports nothing of prefixkv: every layer may use it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["worker_row", "worker_rows"]

_ROW_KEYS = frozenset(("worker", "status", "body"))


def worker_row(worker: str, status: int, body: Any) -> dict[str, Any]:
    """One worker's row of a fan-out answer: its URL, the HTTP status it gave, its JSON body
    (or its text when it sent no JSON)."""
    return {"worker": worker, "status": status, "body": body}


def worker_rows(data: Any) -> list[dict[str, Any]] | None:
    """The per-worker rows when ``data`` (a decoded JSON answer) is a router's fan-out, each
    with ``worker`` (str), ``status`` (int) and ``body``; ``None`` when it is anything else (a
    server's own answer, an error body, a list of other rows, an empty list)."""
    rows = data.get("data") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        return None
    for w in rows:
        if not (isinstance(w, dict) and _ROW_KEYS <= w.keys() and isinstance(w["status"], int)
                and isinstance(w["worker"], str)):
            return None
    return rows
