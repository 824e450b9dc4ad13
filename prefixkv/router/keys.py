"""Route keys: what the router matches, built from a request body in time independent of the
tokenizer and nearly independent of the prompt's length.

The router has no tokenizer (workers may serve any model), so a prompt is keyed by its text: the
UTF-8 bytes of a string prompt, or of a chat rendered ``role\\x1fcontent\\x1e`` per message (a
stable rendering: turn ``t + 1``'s text extends turn ``t``'s, which is all prefix matching needs).
The bytes are cut into pieces at fixed offsets from the start and each piece is hashed to a
32-bit int (xxh32); the key is that sequence of chunk hashes. The pieces follow one schedule for
every prompt: ``LEVEL`` (32) pieces of ``chunk_bytes`` (16), then 32 of twice that, then 32 of
four times that, and so on. A match is thus measured to within 16 bytes on the first 512 and to
within 1/16 of the matched length beyond, and a prompt of ``L`` bytes has about
``32 * log2(L / 512 + 1)`` chunks: 161 for 16 KB, 225 for 64 KB, 353 for 1 MB, instead of one
element per byte. Two prompts share a key prefix exactly when they share their leading full
chunks (the trailing partial chunk is a key element too, so a prompt extended by one byte
matches all of it but that last piece). Prompts given as token ids follow the same schedule with
``chunk_bytes // 4`` ids as the base piece, in a separate namespace. The namespace also carries
the model name and ``cache_salt`` (with SGLang's ``extra_key``), since a worker never shares
cache entries across them.

``RouteKey.size`` is the prompt's length in key units (bytes, or token ids) and ``unit`` the base
piece: a match of ``m`` chunks covers ``chunk_offset(m, unit)`` units, plus half of chunk ``m``
when the match stops inside the prompt (see :meth:`RouteKey.covered`).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from prefixkv.wire.kv_events import request_salt

__all__ = ["DEFAULT_CHUNK_BYTES", "LEVEL", "RouteKey", "chat_key", "chunk_offset",
           "completion_key", "render_messages", "text_key"]

DEFAULT_CHUNK_BYTES = 16
LEVEL = 32
_ROLE_END = "\x1f"
_MESSAGE_END = "\x1e"
_hash = xxhash.xxh32_intdigest
_MASK = 2**32 - 1


@dataclass(frozen=True, slots=True)
class RouteKey:
    """A namespace, the chunk hashes (ints in ``[0, 2**32)``), and the covered length."""

    namespace: Hashable
    chunks: tuple[int, ...]
    size: int = 0
    unit: int = 1

    def __len__(self) -> int:
        return len(self.chunks)

    def covered(self, matched_chunks: int) -> int:
        """Key units the first ``matched_chunks`` chunks are estimated to cover.

        A match that stops inside the prompt is credited with half of the next chunk: the
        expected overlap of a prompt that diverges somewhere inside it (a session's previous
        turn ends there). Without that credit a second turn's ratio would fall short of an
        exact byte match by up to a chunk, enough to cross a 0.5 threshold.
        """
        start = chunk_offset(matched_chunks, self.unit)
        if 0 < matched_chunks < len(self.chunks):
            start += (chunk_offset(matched_chunks + 1, self.unit) - start) // 2
        return min(start, self.size)

    def ratio(self, matched_chunks: int) -> float:
        """Share of the prompt covered by ``matched_chunks`` leading chunks (0.0 if empty)."""
        return self.covered(matched_chunks) / self.size if self.size else 0.0


def chunk_offset(i: int, unit: int) -> int:
    """Where chunk ``i`` starts: ``LEVEL`` chunks of ``unit``, then ``LEVEL`` of ``2 * unit``..."""
    level, within = divmod(i, LEVEL)
    return unit * (LEVEL * ((1 << level) - 1) + within * (1 << level))


_BOUNDS: dict[int, list[int]] = {}


def _bounds(n: int, unit: int) -> list[int]:
    """Chunk start offsets below ``n`` followed by ``n`` (cached per unit, grown on demand)."""
    bounds = _BOUNDS.setdefault(unit, [0])
    while bounds[-1] < n:
        bounds.append(chunk_offset(len(bounds), unit))
    k = bisect.bisect_left(bounds, n)
    return [*bounds[:k], n]


def _check_chunk(chunk_bytes: int) -> None:
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 4:
        raise ValueError(f"chunk_bytes must be an int >= 4, got {chunk_bytes!r}")


def text_key(text: str, namespace: Hashable, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RouteKey:
    """Key of ``text`` in ``namespace``: xxh32 of each ``chunk_bytes`` piece of its UTF-8."""
    _check_chunk(chunk_bytes)
    data = text.encode("utf-8", "surrogatepass")
    b = _bounds(len(data), chunk_bytes)
    chunks = tuple(_hash(data[b[i] : b[i + 1]]) for i in range(len(b) - 1))
    return RouteKey(("text", namespace), chunks, len(data), chunk_bytes)


def _ids_key(ids: Sequence[int], namespace: Hashable, chunk_bytes: int) -> RouteKey:
    per = chunk_bytes // 4
    b = _bounds(len(ids), per)
    # hash() of a tuple of ints is deterministic across processes (no string salt)
    chunks = tuple(hash(tuple(ids[b[i] : b[i + 1]])) & _MASK for i in range(len(b) - 1))
    return RouteKey(("ids", namespace), chunks, len(ids), per)


def body_salt(body: Mapping[str, Any]) -> str | None:
    """The cache salt a worker files a request body's blocks under (``cache_salt`` and SGLang's
    ``extra_key``, :func:`~prefixkv.wire.kv_events.request_salt`); a value that is not a string
    counts as absent (the worker answers its 400)."""
    salt, key = body.get("cache_salt"), body.get("extra_key")
    return request_salt(salt if isinstance(salt, str) else None, key if isinstance(key, str) else None)


def _namespace(body: Mapping[str, Any]) -> Hashable:
    model = body.get("model")
    return (model if isinstance(model, str) else None, body_salt(body))


def completion_key(body: Mapping[str, Any], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RouteKey:
    """Key of a ``/v1/completions`` body; a batch (list of prompts) is keyed by its first one.

    A missing or malformed prompt gives an empty key (the worker answers the 400).
    """
    _check_chunk(chunk_bytes)
    ns = _namespace(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_key(prompt, ns, chunk_bytes)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return _ids_key(prompt, ns, chunk_bytes)
    return RouteKey(("text", ns), ())


def generate_key(body: Mapping[str, Any], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RouteKey:
    """Key of an SGLang ``/generate`` body: its ``input_ids`` or ``text`` keyed as a completion's
    prompt (a batch by its first one)."""
    prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
    return completion_key({"prompt": prompt, "cache_salt": body.get("cache_salt"),
                           "extra_key": body.get("extra_key")}, chunk_bytes)


def render_messages(messages: Iterable[Any]) -> str:
    """The router's stable rendering of chat messages (not the model's chat template)."""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            parts.append(json.dumps(message, sort_keys=True) + _MESSAGE_END)
            continue
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(
                p["text"] if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                else json.dumps(p, sort_keys=True)
                for p in content
            )
        elif not isinstance(content, str):
            content = "" if content is None else json.dumps(content, sort_keys=True)
        parts.append(f"{message.get('role', '')}{_ROLE_END}{content}{_MESSAGE_END}")
    return "".join(parts)


def chat_key(body: Mapping[str, Any], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RouteKey:
    """Key of a ``/v1/chat/completions`` body (empty when ``messages`` is not a list)."""
    messages = body.get("messages")
    text = render_messages(messages) if isinstance(messages, list) else ""
    return text_key(text, _namespace(body), chunk_bytes)


def responses_key(body: Mapping[str, Any], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RouteKey:
    """Key of a ``/v1/responses`` body: its ``instructions`` and ``input`` rendered as chat
    messages are (a request continuing a stored response goes to the worker that holds it:
    :class:`~prefixkv.router.proxy.Router` keeps which one)."""
    items = body.get("input")
    messages: list[Any] = [{"role": "user", "content": items}] if isinstance(items, str) else (
        list(items) if isinstance(items, list) else [])
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    return text_key(render_messages(messages), _namespace(body), chunk_bytes)


def messages_key(body: Mapping[str, Any], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RouteKey:
    """Key of an Anthropic ``/v1/messages`` body: its ``system`` and ``messages`` rendered as chat
    messages are."""
    messages = body.get("messages")
    turns: list[Any] = list(messages) if isinstance(messages, list) else []
    system = body.get("system")
    if system:
        turns.insert(0, {"role": "system", "content": system})
    return text_key(render_messages(turns), _namespace(body), chunk_bytes)


def hinted_key(key_of: Any, body: Mapping[str, Any], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> RouteKey:
    """``key_of(body)``, unless the body carries OpenAI's ``prompt_cache_key`` (a client's hint
    that requests sharing it share a prompt prefix): then a key of that string alone, so such
    requests go to the worker that took the first of them (the policy's load rules still
    apply: when that worker is overloaded the key overflows to another, as OpenAI's does)."""
    hint = body.get("prompt_cache_key")
    if isinstance(hint, str) and hint:
        return text_key(_HINT + hint, _namespace(body), chunk_bytes)
    result: RouteKey = key_of(body, chunk_bytes)
    return result


_HINT = "\x00prompt_cache_key\x00"
"""Prefix of a hint key's text (no rendered prompt starts with it)."""
