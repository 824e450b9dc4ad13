"""Running the model and the sampler so that one request's failure stays its own.

When a batched call raises, it is retried one sequence at a time: the model's K/V writes are
idempotent (a sequence writes only its own private slots, at the same positions), so the
retry is exact. The sequences that still raise are handed to ``fail(seq, exc)``; the caller
ends their requests and frees their blocks, and every other sequence goes on with the
results of the retries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prefixkv.engine.sequence import Sequence as Seq
from prefixkv.engine.sequence import SequenceStatus
from prefixkv.runner.model_runner import RunItem

if TYPE_CHECKING:
    from prefixkv.engine.sampling import Pick, SeqSampler

logger = logging.getLogger(__name__)

FaultHook = Callable[[str, Sequence[Seq]], None]
"""``hook(phase, seqs)``, called with ``phase`` ``"model"`` before the model runs ``seqs`` and
``"sample"`` before their next tokens are sampled; whatever it raises is handled exactly like
a failure of the model or the sampler. For fault-injection tests and chaos drills."""

Execute = Callable[[list[Seq], list[RunItem]], Any]
"""``execute(seqs, items)``: the runner's last-token logits of ``items`` (``items[i]`` is
``seqs[i]``'s work); the engine's wraps ``ModelRunner.execute`` (and records prompt logprobs)."""

Fail = Callable[[Seq, BaseException], None]
"""``fail(seq, exc)``: end ``seq``'s request with ``exc`` (it must mark it finished)."""


def run_model_isolated(
    execute: Execute, seqs: list[Seq], num_new: list[int], hook: FaultHook | None, fail: Fail
) -> tuple[dict[int, int], Any]:
    """Compute ``num_new[i]`` tokens of each ``seqs[i]``; returns ``({i: logits row}, logits)``
    for the sequences that ran (``({}, None)`` if none did)."""
    items = [
        RunItem(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n],
                seq.num_computed_tokens, seq.block_table, seq.request.lora)
        for seq, n in zip(seqs, num_new)
    ]
    try:
        if hook is not None:
            hook("model", seqs)
        return {i: i for i in range(len(seqs))}, execute(seqs, items)
    except Exception as exc:  # noqa: BLE001 - find the culprit below
        if len(seqs) == 1:
            fail(seqs[0], exc)
            return {}, None
    ran: dict[int, int] = {}
    rows = []
    for i, (seq, item) in enumerate(zip(seqs, items)):
        if seq.status is SequenceStatus.FINISHED:  # a sibling's failure ended its request
            continue
        try:
            if hook is not None:
                hook("model", [seq])
            rows.append(execute([seq], [item]))
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            fail(seq, exc)
            continue
        ran[i] = len(rows) - 1
    if not rows:
        return {}, None
    import torch  # the runner's tensors; only concatenated here

    return ran, torch.cat(rows)


def sample_isolated(
    sampler: SeqSampler, logits: Any, rows: list[int], seqs: list[Seq], hook: FaultHook | None,
    fail: Fail,
) -> dict[int, Pick]:
    """``{id(seq): next token}`` for ``seqs[j]`` from row ``rows[j]`` of ``logits``."""
    if not rows:
        return {}
    try:
        if hook is not None:
            hook("sample", seqs)
        return dict(zip((id(s) for s in seqs), sampler.sample(logits, rows, seqs)))
    except Exception as exc:  # noqa: BLE001 - retry one by one below
        logger.debug("batched sampling failed (%r); sampling one sequence at a time", exc)
    out: dict[int, Pick] = {}
    for row, seq in zip(rows, seqs):
        if seq.status is SequenceStatus.FINISHED:
            continue
        try:
            if hook is not None:
                hook("sample", [seq])
            out[id(seq)] = sampler.sample(logits, [row], [seq])[0]
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            fail(seq, exc)
    return out
