"""Prompt logprobs: the engine's model step, recording them for the requests that ask.

A request with ``SamplingParams.prompt_logprobs`` does not read its prompt from the prefix
cache past ``prompt_logprobs_start`` (``KVManager.admit`` limits the match for sample 0 until
its prompt is prefilled), so every position they are wanted for is computed here and they are
exact; the entries up to that start stay ``None``; the blocks still go into the cache for
later requests. A recompute after preemption overwrites the same entries.
Each ``decoded_token`` is the text its token adds after the prompt before it (vLLM's), read
from a detokenizer primed with the :data:`CONTEXT` tokens before a chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixkv.engine.output_processor import TextStream, in_context
from prefixkv.engine.outputs import Logprob
from prefixkv.engine.sampling import SeqSampler
from prefixkv.engine.sequence import Sequence as Seq
from prefixkv.runner.logits_processors import token_logprobs
from prefixkv.runner.model_runner import ModelRunner, RunItem
from prefixkv.runner.prompt_logits import execute_with_prompt_logits


CONTEXT = 8
"""Prompt tokens a chunk's detokenizer is primed with: more than a UTF-8 character's 4 bytes."""


class PromptLogprobsRunner:
    """Wraps ``runner.execute`` (the engine's ``Execute`` for ``run_model_isolated``);
    ``stream`` makes a fresh detokenizer (the prompt's texts)."""

    def __init__(self, runner: ModelRunner, sampler: SeqSampler, stream: Callable[[], TextStream]) -> None:
        self.runner = runner
        self.sampler = sampler
        self._stream = stream

    def execute(self, seqs: list[Seq], items: list[RunItem]) -> Any:
        """The runner's last-token logits of ``items`` (``items[i]`` is ``seqs[i]``'s work);
        records the prompt logprobs of the items whose request asked for them."""
        full = [seq.index == 0 and seq.request.needs_prompt_logprobs for seq in seqs]
        if not any(full):
            return self.runner.execute(items)
        logits, full_logits = execute_with_prompt_logits(self.runner, items, full)
        for i, all_logits in full_logits.items():
            self._record(seqs[i], all_logits)
        return logits

    def _record(self, seq: Seq, logits: Any) -> None:
        """Row ``p`` of ``logits`` is the distribution after position ``start + p``."""
        req = seq.request
        start = seq.num_computed_tokens
        end = min(start + len(logits), seq.num_prompt_tokens - 1)
        skip = max(0, req.params.prompt_logprobs_start - start)  # rows before the wanted ones
        if end <= start + skip or req.prompt_logprobs is None:
            return
        logits, start = logits[skip:], start + skip
        found = token_logprobs(
            logits[: end - start],
            seq.token_ids[start + 1 : end + 1],
            [req.params.prompt_logprobs or 0] * (end - start),
            [req.params.logprob_ids] * (end - start),
        )
        if not req.params.detokenize:  # ids only: no decoded_token
            for pos, t in enumerate(found, start + 1):
                entry = self.sampler.logprob_entry(t)
                req.prompt_logprobs[pos] = {i: Logprob(lp.logprob, lp.rank) for i, lp in entry.items()}
            return
        stream = self._stream()
        for tok in seq.token_ids[max(0, start + 1 - CONTEXT) : start + 1]:
            stream.push((tok,))
        for pos, t in enumerate(found, start + 1):
            req.prompt_logprobs[pos] = in_context(self.sampler.logprob_entry(t), stream)
            stream.push((seq.token_ids[pos],))
