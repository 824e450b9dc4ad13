"""Requests and their sequences: the per-request state the scheduler and engine share.

A :class:`Request` is what a caller submitted (one prompt, one :class:`SamplingParams`); it owns
``n`` :class:`Sequence` objects, one per sample. The scheduler moves sequences between its
queues; the KV manager owns their block tables; the engine appends tokens and decides stops.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from prefixkv.cache.protocol import PrefixMatch, PrefixNode
from prefixkv.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from prefixkv.engine.sampling_params import SamplingParams


class TextStream(Protocol):
    """Incremental detokenizer of one sample (``push`` new ids -> new text; ``flush`` at end)."""

    def push(self, token_ids: Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class GrammarLike(Protocol):
    """A structured-output grammar state (``accept`` a token; ``is_done`` when complete)."""

    def accept(self, token_id: int) -> None: ...

    def is_done(self) -> bool: ...


class SequenceStatus(Enum):
    """Where a sequence is: queued, holding KV blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One submitted prompt and its samples.

    ``namespace`` is the prefix-index partition: ``(cache_salt, lora_id)`` collapsed to ``None``
    when both are ``None``, so tenants with different salts never share cached blocks.
    ``max_tokens`` is resolved at submission (``params.max_tokens`` or the room left in the
    model's context).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    namespace: Hashable | None
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None
    prompt_prefilled: bool = False
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        """Whether every sample is done."""
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)

    def snapshot(self) -> RequestOutput:
        """A :class:`RequestOutput` of the state now; deltas are since the previous snapshot."""
        outs = []
        for seq in self.seqs:
            text = seq.visible_text()
            ids = seq.output_token_ids
            outs.append(
                CompletionOutput(
                    seq.index,
                    text,
                    ids,
                    seq.finish_reason,
                    seq.stop_reason,
                    text[seq.num_reported_chars :],
                    ids[seq.num_reported_tokens :],
                    None if seq.logprobs is None else list(seq.logprobs),
                    None if seq.logprobs is None else seq.cumulative_logprob,
                )
            )
            seq.num_reported_chars, seq.num_reported_tokens = len(text), len(ids)
        m = self.metrics
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outs,
            self.finished,
            self.num_cached_tokens or 0,
            RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time),
            error=self.error,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the prompt must still be computed (not read from the cache) for its logprobs."""
        return self.params.prompt_logprobs is not None and not self.prompt_prefilled


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample's tokens, KV bookkeeping, text and stop state.

    KV bookkeeping (owned by :class:`~prefixkv.engine.kv_manager.KVManager`):
    ``block_table[i]`` holds the KV of tokens ``[i*bs, (i+1)*bs)``; the first
    ``num_indexed_blocks`` entries are held by the prefix index and locked by ``cache_handle``;
    the rest are private to this sequence. ``num_computed_tokens`` leading tokens have KV.
    """

    seq_id: int
    request: Request
    index: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_indexed_blocks: int = 0
    cache_handle: PrefixMatch | PrefixNode | None = None
    generator: object | None = None
    detokenizer: TextStream | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    grammar: GrammarLike | None = None
    stop_check_from: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many ids were generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (>= 1 while running)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Whether prompt tokens are still uncomputed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    def append_token(
        self,
        token_id: int,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        logprobs: dict[int, Logprob] | None = None,
    ) -> None:
        """Add a sampled token, extend the text, and set ``finish_reason`` if it must stop.

        vLLM's rules: no stop (EOS, stop id, stop string) before ``min_tokens`` tokens, and no
        stop string found in the text of the first ``min_tokens`` tokens; the text of a stop
        id or EOS (and a matched stop string) is left out unless ``include_stop_str_in_output``.
        """
        self.token_ids.append(token_id)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id].logprob
        if self.grammar is not None:
            self.grammar.accept(token_id)
        params = self.params
        n_out = self.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in eos_token_ids:
                self.finish_reason = "stop"
            elif token_id in params.stop_ids:
                self.finish_reason, self.stop_reason = "stop", token_id
        old_len = len(self.text)
        if self.detokenizer is not None and (
            self.finish_reason is None or params.include_stop_str_in_output
        ):
            self.text += self.detokenizer.push((token_id,))
        if n_out <= params.min_tokens and params.min_tokens:
            self.stop_check_from = len(self.text)
        elif self.finish_reason is None and params.stop_strings and self._check_stop_strings(old_len):
            return
        if self.finish_reason is None and self.grammar is not None and self.grammar.is_done():
            self.finish_reason = "stop"  # complete (only a stop token could follow) or failed
        if self.finish_reason is None and (
            n_out >= self.request.max_tokens or len(self.token_ids) >= max_model_len
        ):
            self.finish_reason = "length"
        if self.finish_reason is not None and self.detokenizer is not None:
            self.text += self.detokenizer.flush()  # a character cut by the end comes out as U+FFFD

    def visible_text(self) -> str:
        """Text safe to report: while running, hold back what could start a stop string."""
        stops = self.params.stop_strings
        if self.finish_reason is not None or not stops:
            return self.text
        hold = max(len(s) for s in stops) - 1
        return self.text[: max(self.num_reported_chars, len(self.text) - hold)]

    def _check_stop_strings(self, old_len: int) -> bool:
        # Only a match ending in the new text is new: the text before it was checked already.
        start = max(self.stop_check_from, old_len - max(len(s) for s in self.params.stop_strings) + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop_strings:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        keep = best[0] + len(best[1]) if self.params.include_stop_str_in_output else best[0]
        self.text = self.text[:keep]
        self.finish_reason, self.stop_reason = "stop", best[1]
        return True
