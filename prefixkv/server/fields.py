"""Owns: the unknown-field policy every dialect's request model goes through.
Imports: errors.py only.

Unknown request fields: ignored with one warning per name, or refused (``--strict-fields``).

Clients and routers in front of an OpenAI-compatible server add fields of their own (vLLM's
and SGLang's extensions, ``no_stop_trim`` from the Rust routers, SDK defaults). vLLM ignores
fields it does not know and logs them; so do we. Type and range checks of *known* fields stay
strict whatever the policy (pydantic, in each dialect's request models).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from prefixkv.server.errors import APIError

logger = logging.getLogger(__name__)

_SET: Callable[[Any], bool] = lambda v: v is not None and v is not False and v != {} and v != []

UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "bad_words": lambda v: bool(v), "chat_template": lambda v: v is not None,
    "use_beam_search": lambda v: v is True, "length_penalty": lambda v: v not in (None, 1, 1.0),
    "documents": lambda v: v is not None, "echo": lambda v: v is True,
    "thinking_token_budget": lambda v: v is not None,
    # vLLM's: another prompt, P/D or encoder transfer, logits-processor args, early stops, marks
    "prompt_embeds": _SET, "kv_transfer_params": _SET, "ec_transfer_params": _SET,
    "vllm_xargs": _SET, "repetition_detection": _SET, "watermarking": _SET,
    # SGLang's: an adapter (served on /generate only), a custom logits processor, a watermark,
    # /generate's media inputs
    "lora_path": _SET, "custom_logit_processor": _SET, "watermark": _SET,
    "image_data": _SET, "video_data": _SET, "audio_data": _SET,
    # vLLM's chat: special tokens on top of the template's (completions declares its own)
    "add_special_tokens": lambda v: v is True,
}
"""vLLM and SGLang fields this server does not implement and that would change the answer if
ignored (found by diffing their request models against ours): set to such a value (a tester),
they are a 400 naming the field whatever the policy, never dropped (vLLM itself refuses a
request's ``chat_template`` unless told to trust it). ``echo`` is here for chat (completions
declares its own). Unset, empty or at their defaults they pass like any unknown field."""

MAX_WARNED_NAMES = 256
"""After this many distinct unknown names (a fuzzer, a broken client) nothing more is logged,
so the set of remembered names cannot grow without bound."""


def unknown_fields(body: BaseModel, prefix: str = "") -> Iterator[str]:
    """Dotted names of the fields of ``body`` (and of the models inside it) that no model declares,
    e.g. ``"no_stop_trim"``, ``"stream_options.foo"``, ``"messages[0].reasoning"``."""
    for name in body.model_extra or {}:
        yield f"{prefix}{name}"
    for name in type(body).model_fields:
        yield from _inside(getattr(body, name), f"{prefix}{name}")


def _inside(value: Any, path: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        yield from unknown_fields(value, f"{path}.")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel):
                yield from unknown_fields(item, f"{path}[{i}].")


class FieldPolicy:
    """What to do with unknown fields. ``strict``: a 400 naming the first; else log a warning
    the first time each name is seen (thread safe) and go on."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: BaseModel) -> list[str]:
        """The unknown fields of ``body`` (ignored); raises :class:`APIError` when strict."""
        names = list(unknown_fields(body))
        if not names:
            return names
        extra = body.model_extra or {}
        for name, changes_output in UNSUPPORTED.items():
            if name in extra and changes_output(extra[name]):
                raise APIError(f"{name} is not supported by this server (ignoring it would change "
                               "the answer)", param=name, code="unsupported_field")
        if self.strict:
            raise APIError(f"unsupported field {names[0]!r} (the server runs with --strict-fields)",
                           param=names[0], code="extra_forbidden")
        with self._lock:
            room = MAX_WARNED_NAMES - len(self._warned)
            new = list(dict.fromkeys(g for g in map(_generic, names) if g not in self._warned))[:max(room, 0)]
            self._warned.update(new)
        for name in new:
            logger.warning("ignoring unknown request field %r (further ones of this name are "
                           "ignored silently; --strict-fields refuses them)", name)
        return names

    @property
    def warned(self) -> frozenset[str]:
        """The field names warned about so far (list indices dropped)."""
        with self._lock:
            return frozenset(self._warned)


def _generic(name: str) -> str:
    """``messages[3].x`` -> ``messages[].x``: one warning per field, not per message."""
    out, skip = [], False
    for ch in name:
        if ch == "[":
            skip = True
            out.append("[]")
        elif ch == "]":
            skip = False
        elif not skip:
            out.append(ch)
    return "".join(out)
