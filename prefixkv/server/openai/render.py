"""Owns: a completions or chat choice, whole or as a stream delta (echo, logprobs, tool calls).
Imports: prefixkv.engine's outputs, logprobs.py, tools.py.

Choices of completions and chat responses, whole or as stream deltas, from engine outputs.

A :class:`ChoiceRenderer` is built per HTTP request from what it asked for (echo, logprobs,
forced tool calls); ``serving.py`` hands it :class:`RequestOutput` snapshots. Streaming keeps
a :class:`StreamCursor` per sample so each delta carries only new text, token logprobs and,
on its first chunk, the echoed prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixkv.engine.outputs import CompletionOutput, RequestOutput
from prefixkv.server.openai.logprobs import CompletionLogprobs, chat_logprobs
from prefixkv.server.openai.tools import ToolMode, tool_calls


@dataclass(slots=True)
class StreamCursor:
    """How much of one sample has been sent."""

    chars: int = 0
    tokens: int = 0
    started: bool = False
    finished: bool = False
    logprobs: CompletionLogprobs | None = None


@dataclass(slots=True)
class ChoiceRenderer:
    """Renders the choices of one request.

    ``num_logprobs``: ``None`` for no logprobs, else the top alternatives per token.
    ``echo`` (completions): the prompt (and, with logprobs, its logprobs) comes first;
    ``echo_only``: ``max_tokens=0`` with echo, the one generated token is hidden.
    ``prompt_logprobs``: vLLM's ``prompt_logprobs`` field on each choice.
    ``tool_mode``: forced tool calls (chat). ``decode``: a token id's text; ``decode_ids``:
    the text of a list of ids. ``token_ids``: vLLM's ``return_token_ids``: each choice (and
    stream delta) carries its generated ``token_ids``, a completions choice (on its first
    delta) the ``prompt_token_ids`` too (a chat response has them at the top, ``serving.py``).
    ``as_ids``: vLLM's ``return_tokens_as_token_ids``: logprob tokens named ``token_id:<id>``.
    """

    chat: bool
    decode: Any
    decode_ids: Any
    num_logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False
    prompt_logprobs: bool = False
    tool_mode: ToolMode | None = None
    token_ids: bool = False
    as_ids: bool = False
    cursors: dict[tuple[int, int], StreamCursor] = field(default_factory=dict)

    def num_generated(self, o: CompletionOutput) -> int:
        """Completion tokens to report (0 with ``echo_only``)."""
        return 0 if self.echo_only else len(o.token_ids)

    # ------------------------------------------------------------------ whole responses
    def final(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict[str, Any]:
        """The choice of sample ``o`` of ``out`` in a non-streamed response."""
        choice: dict[str, Any] = {"index": index, "logprobs": None,
                                  "finish_reason": o.finish_reason}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": o.text}
            calls = tool_calls(self.tool_mode, o.text) if self.tool_mode is not None else None
            if calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                if self.tool_mode is not None and self.tool_mode.name is None and o.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            choice["message"] = message
            if self.num_logprobs is not None and o.logprobs is not None:
                choice["logprobs"] = chat_logprobs(o.token_ids, o.logprobs, self.num_logprobs, self.decode,
                                                   self.as_ids)
        else:
            builder = (None if self.num_logprobs is None else
                       CompletionLogprobs(self.num_logprobs, as_ids=self.as_ids))
            text, lp = self._completion_piece(out, o, 0, len(o.token_ids), o.text, True, builder)
            choice["text"] = text
            choice["logprobs"] = lp
        choice["stop_reason"] = o.stop_reason
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = _prompt_logprobs_field(out)
        if self.token_ids:
            choice["token_ids"] = [] if self.echo_only else list(o.token_ids)
            if not self.chat:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice

    def _completion_piece(
        self, out: RequestOutput, o: CompletionOutput, tok_from: int, tok_to: int, text: str,
        first: bool, builder: CompletionLogprobs | None,
    ) -> tuple[str, dict[str, Any] | None]:
        ids: list[int] = []
        entries: list[Any] = []
        if self.echo and first:
            prompt_text = out.prompt if out.prompt is not None else self.decode_all(out.prompt_token_ids)
            text = prompt_text + ("" if self.echo_only else text)
            if builder is not None:
                ids += out.prompt_token_ids
                entries += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        elif self.echo_only:
            text = ""
        if builder is not None and not self.echo_only and o.logprobs is not None:
            ids += o.token_ids[tok_from:tok_to]
            entries += o.logprobs[tok_from:tok_to]
        lp = builder.build(ids, entries, self.decode) if builder is not None else None
        return text, lp

    def decode_all(self, ids: list[int]) -> str:
        """Text of several ids."""
        return str(self.decode_ids(ids)) if ids else ""

    # ------------------------------------------------------------------ streaming
    def delta(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict[str, Any] | None:
        """The chunk choice for what sample ``o`` added since the last call (``None``: nothing;
        with ``token_ids``, a token that added no text still gets a chunk, for its id)."""
        cur = self.cursors.get((index, o.index))
        start, first = (cur.tokens, not cur.started) if cur is not None else (0, True)
        found = self._delta(index, out, o)
        if not self.token_ids or (found is None and len(o.token_ids) == start and not first):
            return found
        piece: dict[str, Any] = found if found is not None else {
            "index": index, "logprobs": None, "finish_reason": None,
            **({"delta": {}} if self.chat else {"text": "", "stop_reason": None})}
        piece["token_ids"] = [] if self.echo_only else list(o.token_ids[start:])
        if first and not self.chat:
            piece["prompt_token_ids"] = list(out.prompt_token_ids)
        return piece

    def _delta(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict[str, Any] | None:
        cur = self.cursors.setdefault((index, o.index), StreamCursor())
        first = not cur.started
        cur.started = True
        text = o.text[cur.chars:]
        cur.chars = max(cur.chars, len(o.text))
        tok_from, tok_to = cur.tokens, len(o.token_ids)
        cur.tokens = tok_to
        finish = o.finish_reason if not cur.finished else None
        cur.finished = cur.finished or finish is not None
        if self.tool_mode is not None and self.chat:
            return self._tool_delta(index, o, first, finish)
        piece: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
        if self.chat:
            if not (text or finish or first):
                return None
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text:
                delta["content"] = text
            piece["delta"] = delta
            if self.num_logprobs is not None and o.logprobs is not None and tok_to > tok_from:
                piece["logprobs"] = chat_logprobs(o.token_ids[tok_from:tok_to], o.logprobs[tok_from:tok_to],
                                                  self.num_logprobs, self.decode, self.as_ids)
            return piece
        if self.num_logprobs is not None and cur.logprobs is None:
            cur.logprobs = CompletionLogprobs(self.num_logprobs, as_ids=self.as_ids)
        text, lp = self._completion_piece(out, o, tok_from, tok_to, text, first, cur.logprobs)
        if not (text or finish or (lp and lp["tokens"])):
            return None
        piece["text"] = text
        piece["logprobs"] = lp
        piece["stop_reason"] = o.stop_reason if finish else None
        if first and self.prompt_logprobs:
            piece["prompt_logprobs"] = _prompt_logprobs_field(out)
        return piece

    def _tool_delta(self, index: int, o: CompletionOutput, first: bool, finish: str | None
                    ) -> dict[str, Any] | None:
        """Forced tool calls stream as one ``tool_calls`` delta once the arguments are complete."""
        if not (first or finish):
            return None
        delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
        reason = finish
        if finish:
            calls = tool_calls(self.tool_mode, o.text) if self.tool_mode is not None else None
            if calls is None:
                delta["content"] = o.text
            else:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                if self.tool_mode is not None and self.tool_mode.name is None and finish == "stop":
                    reason = "tool_calls"
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}


def _prompt_logprobs_field(out: RequestOutput) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``{id: {"logprob", "rank", "decoded_token"}}``."""
    if out.prompt_logprobs is None:
        return None
    return [
        None if e is None else {
            str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in e.items()
        }
        for e in out.prompt_logprobs
    ]
