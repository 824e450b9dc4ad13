"""Owns: OpenAI logprobs objects (completions' and chat's).
Imports: prefixkv.engine's outputs only.

OpenAI logprobs objects from the engine's :class:`~prefixkv.engine.outputs.Logprob` records.

Completions (legacy shape, what lm-eval reads)::

    {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
     "text_offset": [int]}

Chat::

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

``-inf`` (a token a grammar or ``logit_bias`` ruled out) is reported as -9999.0, as vLLM does,
since JSON has no infinity. With ``echo``, the first prompt token has ``null`` entries. With
vLLM's ``return_tokens_as_token_ids`` (``as_ids``) every token is named ``"token_id:<id>"``
(tokens that are not valid text on their own stay identifiable; a chat entry's ``bytes`` are
still its text's), and completions' ``text_offset`` counts those names, as vLLM's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixkv.engine.outputs import Logprob

FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR)


def _text(token_id: int, lp: Logprob | None, decode: Any) -> str:
    """A token's text: in context when the engine recorded it, else decoded alone."""
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else str(decode(token_id))


def _name(token_id: int, text: str, as_ids: bool) -> str:
    """How a token is shown: ``token_id:<id>`` with ``as_ids`` (vLLM's form), else its text."""
    return f"token_id:{token_id}" if as_ids else text


def _top(entry: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The ``num`` most likely tokens of ``entry`` by rank."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
    return ranked[:num]


class CompletionLogprobs:
    """Accumulates the completions ``logprobs`` object (text offsets run across calls)."""

    def __init__(self, num_top: int, text_offset: int = 0, as_ids: bool = False) -> None:
        self.num_top = num_top
        self.offset = text_offset
        self.as_ids = as_ids

    def build(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None],
        decode: Any,
    ) -> dict[str, Any]:
        """The object for ``token_ids`` (``entries[i]`` is ``None`` for a first prompt token)."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tok, entry in zip(token_ids, entries):
            text = _name(tok, _text(tok, entry.get(tok) if entry is not None else None, decode), self.as_ids)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_lp(entry[tok].logprob))
            top = {text: _lp(entry[tok].logprob)}  # the chosen token, then the top ones
            for t, lp in _top(entry, self.num_top):
                top.setdefault(_name(t, _text(t, lp, decode), self.as_ids), _lp(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], num_top: int, decode: Any,
    as_ids: bool = False,
) -> dict[str, Any]:
    """The chat ``logprobs`` object for generated ``token_ids``."""
    content = []
    for tok, entry in zip(token_ids, entries):
        text = _text(tok, entry[tok], decode)
        top = []
        for t, lp in _top(entry, num_top):
            s = _text(t, lp, decode)  # (bytes are the text's even when tokens are shown as ids)
            top.append({"token": _name(t, s, as_ids), "logprob": _lp(lp.logprob),
                        "bytes": list(s.encode("utf-8", "replace"))})
        content.append({"token": _name(tok, text, as_ids), "logprob": _lp(entry[tok].logprob),
                        "bytes": list(text.encode("utf-8", "replace")), "top_logprobs": top})
    return {"content": content}
