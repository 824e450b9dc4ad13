"""SeqSampler: maps sequences' :class:`SamplingParams` onto the runner's sampler.

Each seeded sample keeps its own generator (``seed + index``), so its tokens do not depend on
what else is in the batch. Unseeded samples share one engine generator seeded with the
engine's ``seed``, so a whole run is reproducible for the same submissions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.sequence import Sequence as Seq
from prefixkv.runner.model_runner import ModelRunner
from prefixkv.runner.sampler import SamplingRow, make_generator, sample

if TYPE_CHECKING:  # the runner is the torch importer; the engine only passes tensors along
    import torch


class SeqSampler:
    """Picks the next token of each sequence from the runner's logits."""

    def __init__(self, runner: ModelRunner, seed: int) -> None:
        self._device = runner.device
        self._engine_gen = make_generator(seed, runner.device)

    def generator_for(self, params: SamplingParams) -> object | None:
        """A fresh generator for a seeded sample; ``None`` (engine generator) otherwise."""
        if params.greedy or params.seed is None:
            return None
        return make_generator(params.seed, self._device)

    def sample(self, logits: torch.Tensor, rows: Sequence[int], seqs: Sequence[Seq]) -> list[int]:
        """Next token of ``seqs[j]`` from row ``rows[j]`` of ``logits`` ``[B, vocab]``."""
        sampling_rows = []
        for seq in seqs:
            p = seq.params
            if p.greedy:
                sampling_rows.append(SamplingRow())
                continue
            gen = seq.generator if seq.generator is not None else self._engine_gen
            sampling_rows.append(
                SamplingRow(
                    temperature=float(p.temperature),
                    top_k=max(p.top_k, 0),
                    top_p=float(p.top_p),
                    generator=gen,  # type: ignore[arg-type]
                )
            )
        picked = logits[list(rows)] if len(rows) != len(logits) else logits
        return sample(picked, sampling_rows)
