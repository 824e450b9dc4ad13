"""Token sampling from last-token logits: greedy, temperature, top-k, top-p, per-request seed.

Usage (one row of ``logits`` per running request)::

    gen = make_generator(seed=1234, device=logits.device)   # once per request, kept with it
    rows = [SamplingRow(temperature=0.8, top_k=50, top_p=0.95, generator=gen), SamplingRow()]
    token_ids = sample(logits, rows)                        # list[int], one per row

``temperature == 0`` is greedy (argmax; ties go to the lowest id). A request's generator is its
own RNG stream: the same seed, prompt and parameters give the same tokens whatever else is in
the batch. Rows without a generator draw from torch's global RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingRow:
    """How to pick the next token of one request.

    ``top_k <= 0`` and ``top_p >= 1`` disable those filters. ``generator`` (from
    :func:`make_generator`) must live on the logits' device and persist across steps.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``; ``None`` when ``seed`` is ``None``."""
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` ``[V]`` with tokens outside top-k / the top-p nucleus set to ``-inf``.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``
    (the most likely token is always kept).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p  # mass before this token
        drop_sorted[0] = False  # a top_p that rounds to 0 in float32 still keeps the top token
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """One token id per row of ``logits`` ``[B, V]`` (float32 preferred), per ``rows[i]``."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [len(rows), vocab]; got {tuple(logits.shape)} for {len(rows)} rows"
        )
    out = logits.argmax(-1).tolist()
    for i, row in enumerate(rows):
        if row.temperature == 0.0:
            continue
        scaled = filter_logits(logits[i].float() / row.temperature, row.top_k, row.top_p)
        probs = scaled.softmax(-1)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            # a temperature so small that logits overflow, or non-finite logits: the
            # distribution has collapsed onto its mode, so take it instead of raising
            continue
        out[i] = int(torch.multinomial(probs, 1, generator=row.generator).item())
    return out
