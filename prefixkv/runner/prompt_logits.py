"""One model step that also returns the logits of every new position of chosen items.

Prompt log-probabilities (``SamplingParams.prompt_logprobs``, the OpenAI ``echo`` +
``logprobs``) need the distribution after each prompt token, not only after the last one.
:func:`execute_with_prompt_logits` is :meth:`ModelRunner.execute` plus, for the items flagged
in ``full``, the logits of all their new tokens. Only flagged items pay for the extra
``[tokens, vocab]`` logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixkv.runner.model_runner import ModelRunner, RunItem


def execute_with_prompt_logits(
    runner: ModelRunner, items: list[RunItem], full: Sequence[bool]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``(last-token logits [len(items), vocab], {i: logits [len(items[i].token_ids), vocab]})``.

    Row ``p`` of ``full_logits[i]`` is the distribution of the token after position
    ``items[i].start_pos + p``. Same contract and validation as :meth:`ModelRunner.execute`.
    """
    if len(full) != len(items):
        raise ValueError(f"full has {len(full)} flags for {len(items)} items")
    with torch.inference_mode():
        hidden, ends = runner.hidden_states(items)
        last_logits = runner.last_logits(hidden, ends)
        per_item: dict[int, torch.Tensor] = {}
        for i, flag in enumerate(full):
            if flag:
                start = ends[i] - len(items[i].token_ids)
                per_item[i] = runner.model.compute_logits(hidden[start : ends[i]]).float()
    return last_logits, per_item
