"""Prompt inputs: text, token ids or a dict, resolved to token ids; chat rendering.

Thread safe (tokenizer only), so callers may resolve prompts outside the engine thread.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prefixkv.cache._checks import exact_ids_below

PromptInput = str | Sequence[int] | Mapping[str, Any]
"""A prompt: text, token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``; a dict
may also say ``"add_special_tokens": False`` (text tokenized without BOS/EOS) and
``"truncate_prompt_tokens": k`` (keep the last ``k`` tokens, vLLM's left truncation; the first
``k`` with ``"truncation_side": "right"``)."""


def check_text(text: str, what: str = "prompt", max_chars: int | None = None) -> None:
    """``ValueError`` naming ``what`` if ``text`` is not valid Unicode text (a lone surrogate
    such as ``"\\ud800"`` cannot be encoded) or longer than ``max_chars`` characters."""
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(
            f"{what} has {len(text)} characters: far more than the model's context can hold "
            f"(at most {max_chars} characters could fit)"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: {exc.reason} at character {exc.start}"
        ) from None


def resolve_prompt(
    tokenizer: Any, vocab_size: int, prompt: PromptInput, *, max_chars: int | None = None
) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of a prompt; ``ValueError`` naming ``prompt`` if malformed.

    Text is encoded with the tokenizer's special tokens (e.g. BOS) unless a dict says
    ``"add_special_tokens": False``; a dict's ``"truncate_prompt_tokens": k`` keeps the last
    ``k`` ids, or the first ``k`` with ``"truncation_side": "right"`` (the text is then dropped:
    it no longer matches). Ids must be ints in
    ``[0, vocab_size)`` (numpy integers and IntEnum members become plain ints, a bool is
    refused) and there must be at least one. Text longer than ``max_chars`` or
    with lone surrogates is refused before tokenizing (see :func:`check_text`).
    """
    text: str | None = None
    keep: int | None = None
    right = False
    if isinstance(prompt, str):
        check_text(prompt, max_chars=max_chars)
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, Mapping):
        specials, keep, right = _prompt_options(prompt)
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
            check_text(text, max_chars=max_chars)
            ids = tokenizer.encode(text, add_special_tokens=specials)
        else:
            raise ValueError("prompt dict needs 'prompt_token_ids' or 'prompt'")
    else:
        ids = prompt
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {ids!r}")  # noqa: TRY004
    ids = list(ids)
    if keep is not None and len(ids) > keep:
        ids, text = (ids[:keep] if right else ids[len(ids) - keep :]), None
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    # fast path: plain ints in range (one C pass, or no per-item Python branch); else find
    # the culprit
    ok = exact_ids_below(ids, vocab_size)
    if ok is None:
        ok = set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size
    if not ok:
        ids = [_plain_id(t, vocab_size) for t in ids]  # raises naming the first bad one
    return text, ids


def _prompt_options(prompt: Mapping[str, Any]) -> tuple[bool, int | None, bool]:
    """A prompt dict's ``add_special_tokens`` (default ``True``), ``truncate_prompt_tokens``
    (``None``: keep all) and whether ``truncation_side`` is ``"right"``; ``ValueError`` naming
    the bad one."""
    specials = prompt.get("add_special_tokens", True)
    if not isinstance(specials, bool):
        raise ValueError(f"add_special_tokens must be a bool, got {specials!r}")
    keep = prompt.get("truncate_prompt_tokens")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"truncate_prompt_tokens must be an int >= 1 or None, got {keep!r}")
    side = prompt.get("truncation_side")
    if side not in (None, "left", "right"):
        raise ValueError(f"truncation_side must be 'left', 'right' or None, got {side!r}")
    return specials, keep, side == "right"


def _plain_id(t: Any, vocab_size: int) -> int:
    """``t`` as a plain int id (an IntEnum member or a numpy integer converted); ``ValueError``
    naming the prompt for a bool, a non-integer or an id outside ``[0, vocab_size)``."""
    if isinstance(t, (bool, np.bool_)):
        raise ValueError(f"prompt token id {t!r} is a bool, not an int")
    try:
        v = operator.index(t)
    except TypeError:
        raise ValueError(f"prompt token id {t!r} is not an int") from None
    if not 0 <= v < vocab_size:
        raise ValueError(f"prompt token id {v} out of range [0, {vocab_size})")
    return v


def template_options(
    chat_template_kwargs: Mapping[str, Any] | None, add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of :func:`render_chat`: ``chat_template_kwargs`` over the two
    flags (a key there wins, as in vLLM). ``ValueError`` for a non-dict, a ``messages`` key, a
    flag that is not a bool, or both flags true; its message starts with the field at fault
    (``chat_template_kwargs`` or ``continue_final_message``)."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
    opts = dict(chat_template_kwargs or {})
    if "messages" in opts:
        raise ValueError("chat_template_kwargs cannot set 'messages' (pass the messages themselves)")
    opts.setdefault("add_generation_prompt", add_generation_prompt)
    opts.setdefault("continue_final_message", continue_final_message)
    for flag in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(opts[flag], bool):
            raise ValueError(f"chat_template_kwargs.{flag} must be a bool, got {opts[flag]!r}")
    if opts["continue_final_message"] and opts["add_generation_prompt"]:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    return opts


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
    *, continue_final_message: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """Render a conversation with the chat template: ``{"prompt": text, "prompt_token_ids": ids}``.

    ``continue_final_message`` (vLLM's and transformers' flag): the prompt ends right after the
    last message's content, so the model continues that message (an assistant reply begun by
    the caller, "prefill") instead of starting a new turn; ``ValueError`` with
    ``add_generation_prompt`` too, or when the template does not write the content out.

    The text is tokenized without adding special tokens (the template writes them). Special
    tokens typed *inside message content* (``"<|im_start|>"`` in a user's text) are plain text,
    never control tokens, so a user cannot forge a turn or a system message: content that
    contains a special token's string is tokenized literally, the template's own text with its
    special tokens. (Content without such strings is tokenized with the whole rendered text,
    exactly as before.) ``ValueError`` for content that is not valid Unicode.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    msgs = [dict(m) for m in messages]
    specials = _special_strings(tokenizer)
    marked: dict[str, str] = {}
    for i, m in enumerate(msgs):
        content = m.get("content")
        if not isinstance(content, str):
            continue
        check_text(content, f"messages[{i}].content")
        if any(sp in content for sp in specials):
            mark = f"\x00prefixkv-content-{i}\x00"
            marked[mark] = content
            m["content"] = mark
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:
        text = _cut_after_final(text, msgs[-1].get("content") if msgs else None)
    if not marked:
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    pieces = re.split("(" + "|".join(re.escape(k) for k in marked) + ")", text)
    if sorted(p for p in pieces if p in marked) != sorted(marked):
        raise ValueError(
            "messages: content with special-token strings needs a chat template that inserts "
            "each message's content verbatim, once"
        )
    literal = _literal_encoder(tokenizer)
    ids: list[int] = []
    for piece in pieces:
        if piece in marked:
            ids.extend(literal.encode(marked[piece], add_special_tokens=False).ids)
        elif piece:
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return {"prompt": "".join(marked.get(p, p) for p in pieces), "prompt_token_ids": ids}


def _cut_after_final(text: str, final: Any) -> str:
    """``text`` up to the end of the last place the final message's content (or, for templates
    that trim it, its stripped form) appears."""
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    for needle in (final, final.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[: at + len(needle)]
    raise ValueError("continue_final_message: the chat template does not write the final message's content")


def _special_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings of the tokenizer's special added tokens (``()`` if it cannot say)."""
    cached = getattr(tokenizer, "_prefixkv_specials", None)
    if cached is None:
        backend = getattr(tokenizer, "backend", None)
        decoder = getattr(backend, "get_added_tokens_decoder", None)
        cached = tuple(t.content for t in decoder().values() if t.special) if decoder else ()
        tokenizer._prefixkv_specials = cached
    return cached


def _literal_encoder(tokenizer: Any) -> Any:
    """A copy of the tokenizer's backend that encodes special-token strings as plain text."""
    enc = getattr(tokenizer, "_prefixkv_literal", None)
    if enc is None:
        import tokenizers

        enc = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        enc.encode_special_tokens = True
        tokenizer._prefixkv_literal = enc
    return enc
