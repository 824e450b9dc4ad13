"""Prompt inputs: text, token ids or a dict, resolved to token ids; chat rendering.

Thread safe (tokenizer only), so callers may resolve prompts outside the engine thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PromptInput = str | Sequence[int] | Mapping[str, Any]
"""A prompt: text, token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``."""


def resolve_prompt(tokenizer: Any, vocab_size: int, prompt: PromptInput) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of a prompt; ``ValueError`` naming ``prompt`` if malformed.

    Text is encoded with the tokenizer's special tokens (e.g. BOS); ids must lie in
    ``[0, vocab_size)`` and there must be at least one.
    """
    text: str | None = None
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
            ids = tokenizer.encode(text)
        else:
            raise ValueError("prompt dict needs 'prompt_token_ids' or 'prompt'")
    else:
        ids = prompt
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {ids!r}")  # noqa: TRY004
    ids = list(ids)
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    # fast path: plain ints in range (no per-item Python branch); else find the culprit
    if not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) >= vocab_size:
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt token id {t!r} out of range [0, {vocab_size})")
        ids = [int(t) for t in ids]  # int subclasses (e.g. IntEnum) become plain ints
    return text, ids


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
) -> dict[str, Any]:
    """Render a conversation with the chat template: ``{"prompt": text, "prompt_token_ids": ids}``.

    The text is tokenized without adding special tokens (the template writes them).
    """
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, **kwargs
    )
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
