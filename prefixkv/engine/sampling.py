"""SeqSampler: maps sequences' :class:`SamplingParams` onto the runner's logits processing and sampler.

Each seeded sample keeps its own generator (``seed + index``), so its tokens do not depend on
what else is in the batch. Unseeded samples share one engine generator seeded with the
engine's ``seed``, so a whole run is reproducible for the same submissions.

Per step and row (order as vLLM): structured-output mask -> reported logprobs ->
``min_tokens`` / ``logit_bias`` / penalties / ``min_p`` -> temperature, top-k, top-p, draw.
Penalties and biases apply to greedy rows too (argmax of the processed logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixkv.engine.outputs import Logprob
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.sequence import Sequence as Seq
from prefixkv.engine.structured_output import GrammarState
from prefixkv.runner.logits_processors import (
    RowProcessing,
    TokenLogprobs,
    apply_grammar_mask,
    process_logits,
    token_logprobs,
)
from prefixkv.runner.model_runner import ModelRunner
from prefixkv.runner.sampler import SamplingRow, make_generator, sample

if TYPE_CHECKING:  # the runner is the torch importer; the engine only passes tensors along
    import torch


@dataclass(frozen=True, slots=True)
class Pick:
    """A sampled token and, if the request asked for them, its logprobs entry."""

    token_id: int
    logprobs: dict[int, Logprob] | None = None


class SeqSampler:
    """Picks the next token of each sequence from the runner's logits.

    ``eos_token_ids`` are masked (with ``stop_token_ids``) until ``min_tokens`` are generated;
    ``decode`` gives a token's text for logprob records.
    """

    def __init__(
        self, runner: ModelRunner, seed: int, eos_token_ids: frozenset[int], decode: Callable[[int], str]
    ) -> None:
        self._device = runner.device
        self._vocab = runner.config.vocab_size
        self._engine_gen = make_generator(seed, runner.device)
        self._eos = eos_token_ids
        self._decode = decode
        self._texts: dict[int, str] = {}

    def generator_for(self, params: SamplingParams) -> object | None:
        """A fresh generator for a seeded sample; ``None`` (engine generator) otherwise."""
        if params.greedy or params.seed is None:
            return None
        return make_generator(params.seed, self._device)

    def sample(self, logits: torch.Tensor, rows: Sequence[int], seqs: Sequence[Seq]) -> list[Pick]:
        """Next token of ``seqs[j]`` from row ``rows[j]`` of ``logits`` ``[B, vocab]``."""
        picked = logits[list(rows)] if len(rows) != logits.shape[0] else logits
        processing = [self._processing(s) for s in seqs]
        if all(p is None and s.params.greedy and s.grammar is None and s.params.logprobs is None
               for p, s in zip(processing, seqs)):  # greedy, nothing to apply: one argmax
            return [Pick(tok, None) for tok in picked.argmax(-1).tolist()]
        matchers = [s.grammar.matcher if isinstance(s.grammar, GrammarState) else None for s in seqs]
        picked = apply_grammar_mask(picked, matchers)
        processed = process_logits(picked, processing)
        tokens = sample(processed, [self._sampling_row(s) for s in seqs])
        want = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
        entries: dict[int, dict[int, Logprob]] = {}
        if want:
            found = token_logprobs(
                picked[want], [tokens[j] for j in want], [seqs[j].params.logprobs or 0 for j in want],
                [seqs[j].params.logprob_ids for j in want],
            )
            entries = {j: self.logprob_entry(t) for j, t in zip(want, found)}
        return [Pick(tok, entries.get(j)) for j, tok in enumerate(tokens)]

    def logprob_entry(self, t: TokenLogprobs) -> dict[int, Logprob]:
        """``{chosen id: Logprob, then the top ids}`` (the chosen id first, as vLLM)."""
        out = {t.token_id: Logprob(t.logprob, t.rank, self._text(t.token_id))}
        for tok, lp, rank in t.top:
            if tok not in out:
                out[tok] = Logprob(lp, rank, self._text(tok))
        return out

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode(token_id)
        return text

    def _sampling_row(self, seq: Seq) -> SamplingRow:
        p = seq.params
        if p.greedy:
            return SamplingRow()
        gen = seq.generator if seq.generator is not None else self._engine_gen
        return SamplingRow(
            temperature=float(p.temperature),
            top_k=max(p.top_k, 0),
            top_p=float(p.top_p),
            generator=gen,  # type: ignore[arg-type]
        )

    def _processing(self, seq: Seq) -> RowProcessing | None:
        p = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens and seq.grammar is None:
            eos = () if p.ignore_eos else tuple(self._eos)
            banned = tuple(sorted(t for t in set(eos) | set(p.stop_ids) if t < self._vocab))
        if not (banned or p.bias or p.has_penalties or p.min_p > 0.0 or p.allowed_token_ids):
            return None
        n = seq.num_prompt_tokens
        return RowProcessing(
            allowed=p.allowed,
            banned=banned,
            bias=p.bias,
            presence=float(p.presence_penalty),
            frequency=float(p.frequency_penalty),
            repetition=float(p.repetition_penalty),
            prompt_ids=seq.token_ids[:n] if p.repetition_penalty != 1.0 else (),
            output_ids=seq.token_ids[n:],
            min_p=float(p.min_p),
            temperature=0.0 if p.greedy else float(p.temperature),
        )
