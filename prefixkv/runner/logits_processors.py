"""Logits processing before sampling, and the log-probabilities reported to callers.

The engine applies, per row of last-token logits and in vLLM's order:

1. :func:`apply_grammar_mask`: a structured-output grammar's allowed tokens (others -> -inf);
   reported log-probabilities are taken here (:func:`token_logprobs`), before anything else
   (vLLM's default ``raw_logprobs``);
2. :func:`process_logits`: ``min_tokens`` (EOS / stop ids -> -inf), ``logit_bias``, the
   repetition, frequency and presence penalties, then ``min_p``;
3. :func:`prefixkv.runner.sampler.sample`: temperature, top-k, top-p, the draw.

``min_p`` keeps tokens with ``p >= min_p * p_max`` *after temperature*; since
``p_i / p_max = exp((l_i - l_max) / T)`` that is ``l_i >= l_max + T * log(min_p)``, so it is
applied here on the unscaled logits without touching the sampler. Functions return new
tensors; inputs are not modified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask


@dataclass(slots=True)
class RowProcessing:
    """What to do to one row's logits before sampling (all defaults: nothing).

    ``allowed``: when not empty, every other id is masked to -inf (first).
    ``banned``: ids masked to -inf (EOS and stop ids while ``min_tokens`` is not reached).
    ``bias``: ``(token_id, bias)`` pairs added to the logits.
    ``presence`` / ``frequency``: penalties over ``output_ids``; ``repetition``: over
    ``prompt_ids`` and ``output_ids`` (vLLM semantics). ``min_p`` uses ``temperature``
    (ignored when greedy).
    """

    allowed: Sequence[int] = ()
    banned: Sequence[int] = ()
    bias: Sequence[tuple[int, float]] = ()
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    min_p: float = 0.0
    temperature: float = 0.0

    @property
    def is_noop(self) -> bool:
        """Whether this row's logits pass through unchanged."""
        return not (
            self.allowed
            or self.banned
            or self.bias
            or self.presence
            or self.frequency
            or self.repetition != 1.0
            or (self.min_p > 0.0 and self.temperature > 0.0)
        )


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability of one chosen token and the most likely alternatives.

    ``rank`` is 1 for the most likely token. ``top`` holds ``(token_id, logprob, rank)`` of the
    ``k`` most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float, int]] = field(default_factory=list)


def apply_grammar_mask(logits: torch.Tensor, matchers: Sequence[Any | None]) -> torch.Tensor:
    """``logits`` ``[B, V]`` with tokens a row's llguidance matcher disallows set to -inf.

    Rows whose matcher is ``None`` or in an error state pass through unchanged (the engine
    ends such a sequence).
    """
    live = [(i, m) for i, m in enumerate(matchers) if m is not None and not m.is_error()]
    if not live:
        return logits
    rows = [i for i, _ in live]
    vocab = logits.shape[-1]
    bitmask = allocate_token_bitmask(len(rows), vocab)
    for j, (_, m) in enumerate(live):
        fill_next_token_bitmask(m, bitmask, j)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    out = logits.clone()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
    return out


def process_logits(logits: torch.Tensor, rows: Sequence[RowProcessing | None]) -> torch.Tensor:
    """``logits`` ``[B, V]`` after each row's :class:`RowProcessing` (``None``: unchanged)."""
    if all(r is None or r.is_noop for r in rows):
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    for i, r in enumerate(rows):
        if r is None or r.is_noop:
            continue
        row = out[i]
        if r.allowed:
            keep = torch.tensor(list(r.allowed), dtype=torch.long, device=row.device)
            kept = row[keep]
            row.fill_(float("-inf"))
            row[keep] = kept
        if r.banned:
            row[torch.tensor(list(r.banned), dtype=torch.long, device=row.device)] = float("-inf")
        if r.bias:
            ids = torch.tensor([t for t, _ in r.bias], dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in r.bias], dtype=row.dtype, device=row.device))
        if r.repetition != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen_ids = list(r.prompt_ids) + list(r.output_ids)
            if seen_ids:
                seen[torch.tensor(seen_ids, dtype=torch.long, device=row.device)] = True
            penalised = torch.where(row > 0, row / r.repetition, row * r.repetition)
            row.copy_(torch.where(seen, penalised, row))
        if (r.presence or r.frequency) and r.output_ids:
            counts = torch.bincount(
                torch.tensor(list(r.output_ids), dtype=torch.long, device=row.device), minlength=vocab
            )[:vocab].to(row.dtype)
            row -= r.frequency * counts + r.presence * (counts > 0).to(row.dtype)
        if r.min_p > 0.0 and r.temperature > 0.0:
            floor = row.max() + r.temperature * math.log(r.min_p)
            row.masked_fill_(row < floor, float("-inf"))
    return out


def token_logprobs(
    logits: torch.Tensor, chosen: Sequence[int], num_top: Sequence[int],
    extra: Sequence[Sequence[int]] | None = None,
) -> list[TokenLogprobs]:
    """For each row ``i`` of ``logits`` ``[N, V]``: the log-probability and rank of
    ``chosen[i]`` and the ``num_top[i]`` most likely tokens (capped at ``V``), then those of
    the ids ``extra[i]`` (vLLM's ``logprob_token_ids``) not among them."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(chosen), dtype=torch.long, device=lp.device)
    picked = lp.gather(1, ids.unsqueeze(1))
    ranks = ((lp > picked).sum(dim=1) + 1).tolist()
    k = min(max(num_top, default=0), lp.shape[-1])
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        vals, idx = lp.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), idx.tolist()
    out = []
    for i, tok in enumerate(chosen):
        n = min(num_top[i], k)
        top = [(top_ids[i][j], top_vals[i][j], j + 1) for j in range(n)]
        if extra is not None and extra[i]:
            have = {e[0] for e in top}
            top += _of_ids(lp[i], [t for t in extra[i] if t not in have])
        out.append(TokenLogprobs(int(tok), float(picked[i, 0]), int(ranks[i]), top))
    return out


def _of_ids(row: torch.Tensor, ids: Sequence[int]) -> list[tuple[int, float, int]]:
    """``(id, logprob, rank)`` of each of ``ids`` in the log-probabilities ``row`` ``[V]`` (one
    ``len(ids) x V`` comparison for the ranks, as vLLM's sampler counts them)."""
    if not ids:
        return []
    vals = row[torch.tensor(list(ids), dtype=torch.long, device=row.device)]
    ranks = ((row.unsqueeze(0) > vals.unsqueeze(1)).sum(dim=1) + 1).tolist()
    return [(int(t), float(v), int(r)) for t, v, r in zip(ids, vals.tolist(), ranks)]
