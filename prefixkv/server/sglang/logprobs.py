"""Owns: ``/generate``'s logprob options and SGLang's ``meta_info`` logprob lists.
Imports: prefixkv.engine's outputs and the core's bodies.py only.

SGLang's logprob fields of ``POST /generate``: the request's options and ``meta_info``'s lists.

With ``return_logprob`` a result's ``meta_info`` carries, as SGLang's does:

* ``input_token_logprobs``: ``[logprob, token_id, text]`` for each prompt token from
  ``logprob_start_len`` on (``[]`` with the default -1: output tokens only); the first entry's
  logprob is ``None`` (nothing before it was computed), the others are the token's
  log-probability given the tokens before it;
* ``output_token_logprobs``: the same for each generated token;
* with ``top_logprobs_num`` k > 0, ``input_top_logprobs`` / ``output_top_logprobs``: per position
  the k most likely tokens as ``[logprob, token_id, text]`` (``None`` where the position has none).
* with ``token_ids_logprob`` (ids), ``input_token_ids_logprobs`` / ``output_token_ids_logprobs``:
  per position those ids' ``[logprob, token_id, text]`` in the order given (the engine's
  :attr:`SamplingParams.logprob_token_ids`; ``None`` where the position has none).

``text`` is the token decoded alone with ``return_text_in_logprobs`` (SGLang's), else ``None``.
The prompt is read from the prefix cache up to ``logprob_start_len`` and computed after it
(:attr:`SamplingParams.prompt_logprobs_start`), so SGLang's frontend's ``select`` (a shared
prompt, then each choice's logprobs from just before it) reuses the cached prompt here too.
Log-probabilities are the model's distribution (vLLM's raw logprobs; SGLang's default too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field, StrictBool

from prefixkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from prefixkv.server.bodies import MAX_LOGPROBS, _Body

Triple = tuple[float | None, int, str | None]
"""SGLang's ``(logprob, token_id, text)`` (a JSON list)."""


class LogprobOptions(_Body):
    """The request's logprob fields (SGLang's names and defaults)."""

    return_logprob: StrictBool = False
    logprob_start_len: Annotated[int, Field(strict=True, ge=-1)] = -1
    top_logprobs_num: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] = 0
    return_text_in_logprobs: StrictBool = False
    token_ids_logprob: list[int] | None = None

    def engine_fields(self) -> dict[str, Any]:
        """The :class:`SamplingParams` fields these options set (none without ``return_logprob``)."""
        if not self.return_logprob:
            return {}
        fields: dict[str, Any] = {"logprobs": self.top_logprobs_num}
        if self.token_ids_logprob:  # (SGLang reads [] as none)
            fields["logprob_token_ids"] = self.token_ids_logprob
        if self.logprob_start_len >= 0:
            fields.update(prompt_logprobs=self.top_logprobs_num,
                          prompt_logprobs_start=self.logprob_start_len)
        return fields

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """SGLang's rule: the start may be at most the prompt's length (``ValueError``)."""
        if self.return_logprob and self.logprob_start_len > num_prompt_tokens:
            raise ValueError(f"logprob_start_len ({self.logprob_start_len}) is higher than the number "
                             f"of input tokens ({num_prompt_tokens}); use a smaller logprob_start_len")


class LogprobFormatter:
    """Builds ``meta_info``'s logprob lists for one response (``decode(id)``: a token alone)."""

    def __init__(self, options: LogprobOptions, decode: Callable[[int], str]) -> None:
        self.options = options
        self._decode = decode
        self._texts: dict[int, str] = {}

    def _text(self, token_id: int) -> str | None:
        if not self.options.return_text_in_logprobs:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode(token_id)
        return text

    def _triple(self, entry: dict[int, Logprob] | None, token_id: int) -> Triple:
        lp = None if entry is None or token_id not in entry else entry[token_id].logprob
        return (lp, token_id, self._text(token_id))

    def _top(self, entry: dict[int, Logprob] | None) -> list[Triple] | None:
        if entry is None:
            return None
        k = self.options.top_logprobs_num
        best = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items()
                      if lp.rank is not None and lp.rank <= k)
        return [(v, t, self._text(t)) for _, t, v in best[:k]]

    def meta(self, out: RequestOutput, o: CompletionOutput, generated: int) -> dict[str, Any]:
        """The fields for choice ``o`` of ``out`` (its first ``generated`` tokens count)."""
        opts = self.options
        start = opts.logprob_start_len
        ids = out.prompt_token_ids
        prompt = out.prompt_logprobs or []
        spots = range(start, len(ids)) if start >= 0 else range(0)
        entries = [prompt[p] if p < len(prompt) and p > start else None for p in spots]
        gen = (o.logprobs or [])[:generated]
        meta: dict[str, Any] = {
            "input_token_logprobs": [self._triple(e, ids[p]) for e, p in zip(entries, spots)],
            "output_token_logprobs": [self._triple(e, t) for e, t in zip(gen, o.token_ids)],
        }
        if opts.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [self._top(e) for e in entries]
            meta["output_top_logprobs"] = [self._top(e) for e in gen]
        if opts.token_ids_logprob:
            meta["input_token_ids_logprobs"] = [self._of_ids(e) for e in entries]
            meta["output_token_ids_logprobs"] = [self._of_ids(e) for e in gen]
        return meta

    def _of_ids(self, entry: dict[int, Logprob] | None) -> list[Triple] | None:
        if entry is None:
            return None
        return [(entry[t].logprob, t, self._text(t)) for t in self.options.token_ids_logprob or () if t in entry]
