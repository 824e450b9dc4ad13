"""Owns: Anthropic's ``cache_control`` breakpoints: their place, retention and usage numbers.
Imports: prefixkv.cache (Retention), prefixkv.engine, the core's errors and retention, messages.py.

Where each breakpoint falls in the prompt, what it retains, and the
``cache_creation_input_tokens`` / ``cache_read_input_tokens`` a request reports.

A breakpoint is a ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on a tool, a
system block, a message's content block, or the request itself (Anthropic's automatic caching:
the whole conversation before the answer). As Anthropic's API does, a request holds at most 4,
and a ``"1h"`` breakpoint may not follow a ``"5m"`` one (400s naming the field).

Where a breakpoint falls: the conversation cut just after the marked part (later tools, blocks
and messages dropped; a tool's cut keeps no system or messages: Anthropic's order is tools,
system, messages) is rendered with the chat template; the breakpoint is the longest common
prefix of that and the request's prompt, in tokens. A prefix the template does not render in
front (tools after the system text) ends where the two part.

What happens there: once the request's prompt is computed (its first token), the full blocks of
each breakpoint's prefix are retained in the pool and every lower tier for the TTL (priority 0,
renewed by every hit; ``server/retention.py``), in the request's tenant (``cache_salt``, its
LoRA adapter), within its quota (past it: not retained, not counted as created).

Usage, in Anthropic's terms and prefixkv's block granularity (``block_size`` tokens, 16 by
default; Anthropic's minimum cacheable prompt is 1,024+ tokens, prefixkv's one block):

* ``cache_read_input_tokens``: the prompt tokens read from the cache (any tier), breakpoint or
  not: prefixkv caches every prefix, so a hit past the last breakpoint is read too;
* ``cache_creation_input_tokens``: the tokens the request newly wrote at its breakpoints: from
  what it read to the end of the deepest retained breakpoint's last full block (a breakpoint
  mid-block retains up to the block before it), split by TTL in ``cache_creation``
  (``ephemeral_5m_input_tokens``, ``ephemeral_1h_input_tokens``);
* ``input_tokens``: the rest (prompt - read - created).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixkv.cache.retention import Retention, RetentionError
from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.engine.outputs import RequestOutput
from prefixkv.server.anthropic.messages import (CacheControl, CountTokensRequest, MessagesRequest,
                                                chat_tools, turns)
from prefixkv.server.errors import APIError
from prefixkv.server.retention import CACHE_CONTROL_TTL

logger = logging.getLogger(__name__)

MAX_BREAKPOINTS = 4
"""Anthropic's cap on ``cache_control`` marks in one request."""


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """One mark: where it is (a field path), its TTL name, and the request cut just after it."""

    where: str
    ttl: str
    cut: MessagesRequest | CountTokensRequest


@dataclass(slots=True)
class CacheWrites:
    """What a request wrote at its breakpoints (tokens, per TTL name), filled once its prompt
    is computed."""

    by_ttl: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_CONTROL_TTL, 0))

    @property
    def total(self) -> int:
        """Tokens created at every breakpoint."""
        return sum(self.by_ttl.values())

    def usage(self) -> dict[str, Any]:
        """Anthropic's ``cache_creation_input_tokens`` and its ``cache_creation`` split."""
        return {"cache_creation_input_tokens": self.total, "cache_creation": {
            f"ephemeral_{ttl}_input_tokens": n for ttl, n in self.by_ttl.items()}}


def breakpoints(req: MessagesRequest | CountTokensRequest) -> list[Breakpoint]:
    """The request's marks in prompt order (tools, system, messages, then the request's own);
    ``APIError`` naming the field for more than :data:`MAX_BREAKPOINTS` or a ``"1h"`` after a
    ``"5m"``."""
    marks: list[Breakpoint] = []

    def add(where: str, mark: CacheControl | None, **cut: Any) -> None:
        if mark is not None:
            marks.append(Breakpoint(where, mark.ttl, req.model_copy(update=cut)))

    for k, tool in enumerate(req.tools or []):
        add(f"tools[{k}]", tool.cache_control, tools=req.tools[: k + 1] if req.tools else None,
            system=None, messages=[])
    if isinstance(req.system, list):
        for j, b in enumerate(req.system):
            add(f"system[{j}]", b.cache_control, system=req.system[: j + 1], messages=[])
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            for j, b in enumerate(m.content):
                cut = m.model_copy(update={"content": m.content[: j + 1]})
                add(f"messages[{i}].content[{j}]", b.cache_control,
                    messages=[*req.messages[:i], cut])
    add("cache_control", req.cache_control)
    if len(marks) > MAX_BREAKPOINTS:
        raise APIError(f"a request may hold at most {MAX_BREAKPOINTS} cache_control breakpoints, "
                       f"found {len(marks)}", param=marks[MAX_BREAKPOINTS].where)
    for before, after in zip(marks, marks[1:]):
        if CACHE_CONTROL_TTL[after.ttl] > CACHE_CONTROL_TTL[before.ttl]:
            raise APIError(f"a cache_control with ttl {after.ttl!r} must not follow one with ttl "
                           f"{before.ttl!r} (longer TTLs come first)",
                           param=f"{after.where}.cache_control")
    return marks


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


async def render_cuts(engine: AsyncEngine, marks: list[Breakpoint]) -> list[list[int]]:
    """Each mark's cut conversation through the chat template, in tokens (empty where it does
    not render). Never raises; the route starts it beside the request's prefill."""
    out: list[list[int]] = []
    for mark in marks:
        cut = mark.cut
        tools = chat_tools(cut.tools) if cut.tools else None
        try:
            rendered = await engine.chat_prompt_async(turns(cut), False,
                                                      **({"tools": tools} if tools else {}))
            out.append(list(rendered["prompt_token_ids"]))
        except Exception:  # noqa: BLE001 - a cut the template refuses retains nothing
            out.append([])
    return out


async def retain(engine: AsyncEngine, marks: list[Breakpoint], cuts: Awaitable[list[list[int]]],
                 out: RequestOutput, writes: CacheWrites, *, cache_salt: str | None,
                 lora: str | None) -> None:
    """Retain each mark's prefix of ``out``'s prompt (where its cut, of :func:`render_cuts`,
    parts from it: its cached full blocks, in the request's tenant) and count in ``writes``
    what the request created there. Never raises: a failure leaves that breakpoint uncreated
    (logged)."""
    if out.error is not None or not marks:
        return
    prompt = list(out.prompt_token_ids)
    size = engine.engine.block_size
    try:
        ends = [_common(cut, prompt) for cut in await cuts]
        covered = out.num_cached_tokens
        for mark, end in sorted(zip(marks, ends), key=lambda x: x[1]):
            ids, keep = prompt[: end // size * size], Retention(0, CACHE_CONTROL_TTL[mark.ttl])
            if not ids:
                continue
            try:
                blocks = await engine.retain_cached_prefix(ids, keep, cache_salt=cache_salt,
                                                           lora_request=lora)
            except RetentionError:
                continue  # the tenant's quota: cached, not retained
            kept = blocks * size
            writes.by_ttl[mark.ttl] += max(0, kept - covered)
            covered = max(covered, kept)
    except Exception:  # noqa: BLE001 - retention is best effort; the answer still goes out
        logger.exception("retaining the cache_control breakpoints failed")


def usage(chat_usage: dict[str, Any] | None, writes: CacheWrites | None) -> dict[str, Any]:
    """Chat ``usage`` in Anthropic's terms (``writes``: what the breakpoints created)."""
    u = chat_usage or {}
    prompt = u.get("prompt_tokens", 0)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    w = writes if writes is not None else CacheWrites()
    return {"input_tokens": prompt - cached - w.total, "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, **w.usage()}


__all__ = ["MAX_BREAKPOINTS", "Breakpoint", "CacheWrites", "breakpoints", "render_cuts", "retain",
           "usage"]
