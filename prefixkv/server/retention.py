"""Owns: what retention a request may ask for (every dialect maps its fields here).
Imports: prefixkv.cache.retention only.

Clients ask the cache to keep their prefixes (docs/cache.md, "Retention"; docs/server.md,
"Retention"): OpenAI's ``prompt_cache_retention``, Anthropic's ``cache_control`` TTLs, and vLLM's
and SGLang's ``priority``. Each becomes one :class:`~prefixkv.cache.Retention` here:

* the TTL is the one asked for (``"24h"``: a day; Anthropic's ``"5m"`` / ``"1h"``), or
  :data:`REQUEST_TTL_S` when only a ``priority`` is given;
* the priority is the request's ``priority`` field clamped to ``[0, max_retention_priority]``
  (``--max-retention-priority``, :class:`~prefixkv.server.limits.ServerLimits`); without one, 0:
  a retained block still outlives every unretained one, and an operator's retention (the admin
  API, priority up to 100) outlives a request's unless the operator raises the cap.

A request never pins (a pin is the operator's alone), and a tenant retains at most its quota
(``--max-cached-blocks-per-tenant``): past it the retention is skipped, the request still runs.
"""

from __future__ import annotations

from prefixkv.cache.retention import MAX_PRIORITY, Retention

REQUEST_TTL_S = 300.0
"""TTL of a retention asked for by ``priority`` alone (Anthropic's default cache TTL)."""

PROMPT_CACHE_RETENTION: dict[str, float | None] = {"in_memory": None, "24h": 86400.0}
"""OpenAI's ``prompt_cache_retention`` values: ``"in_memory"`` is the eviction policy alone."""

CACHE_CONTROL_TTL: dict[str, float] = {"5m": 300.0, "1h": 3600.0}
"""Anthropic's ``cache_control.ttl`` values (``"5m"`` when absent)."""

__all__ = ["CACHE_CONTROL_TTL", "MAX_PRIORITY", "PROMPT_CACHE_RETENTION",
           "REQUEST_TTL_S", "request_retention"]


def request_retention(*, priority: int | None, ttl_s: float | None, cap: int) -> Retention | None:
    """The retention a request asks for: ``ttl_s`` (``None``: not asked) at ``priority``
    clamped to ``[0, cap]``; a positive priority alone retains :data:`REQUEST_TTL_S`. ``None``
    when nothing is asked (or only a priority the cap brings to 0)."""
    level = 0 if priority is None or priority <= 0 else min(priority, cap)
    if ttl_s is None:
        return None if level == 0 else Retention(level, REQUEST_TTL_S)
    return Retention(level, ttl_s)
