"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each :meth:`Scheduler.schedule` call builds one step:

1. Running sequences first, oldest first: a decode takes 1 token of the budget, an unfinished
   prefill takes its next chunk. If the pool cannot cover a sequence's new tokens (even after
   evicting unlocked cached blocks), the newest running sequence is preempted by recompute:
   its blocks are released (indexed ones stay cached, now evictable) and it goes back to the
   front of the waiting queue, where re-admission finds its prefix in the cache.
2. If nothing was preempted, waiting sequences are admitted in the order of the schedule
   policy (:mod:`prefixkv.engine.schedule_policy`: arrival order for ``fcfs``, cached or
   shared prefixes first for ``lpm`` / ``dfs-weight``, with a starvation bound) while budget,
   ``max_num_seqs`` and blocks allow. Admission looks up the prefix first, so only uncached
   tokens cost budget. Sample ``i > 0`` of an ``n > 1`` request waits until sample 0 has
   prefilled the prompt, so the samples share the prompt's cached blocks; likewise a sequence
   sharing an uncached prefix with one admitted in the same step waits one step (16 concurrent
   prompts with one system prompt compute it once, not 16 times).

With lower KV tiers, the first ``PREFETCH_AHEAD`` sequences still waiting after a step start
reading their disk / remote blocks into host memory in the background
(``KVManager.prefetch``), so their admission later copies instead of reading.

A waiting sequence that cannot be admitted while nothing runs can never run (pinned blocks
fill the pool); it is finished with ``finish_reason="abort"`` instead of hanging.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixkv.engine.kv_manager import KVManager
from prefixkv.engine.schedule_policy import AdmissionOrder
from prefixkv.engine.sequence import Sequence, SequenceStatus

PREFETCH_AHEAD = 8
"""Sequences at the head of the waiting queue whose lower-tier blocks are read ahead."""
MIN_SHARED_TOKENS = 16
"""A waiting sequence defers one step when it shares this many uncached prompt tokens with
a sequence admitted in the same step (see :meth:`Scheduler._shares_uncached`)."""


def _common_prefix(a: list[int], b: list[int], block_size: int, limit: int) -> int:
    """Length of the longest common block-aligned prefix of ``a[:limit]`` and ``b``."""
    n = min(limit, len(b))
    stride = block_size * max(1, 64 // block_size)
    i = 0
    while i + stride <= n and a[i : i + stride] == b[i : i + stride]:
        i += stride
    while i + block_size <= n and a[i : i + block_size] == b[i : i + block_size]:
        i += block_size
    return i


@dataclass(slots=True)
class ScheduledSeq:
    """A sequence and how many of its uncomputed tokens run this step."""

    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: what runs, what was preempted, what was refused for good."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    aborted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues; uses the :class:`KVManager` for blocks.

    ``policy``: ``fcfs`` (default), ``lpm`` or ``dfs-weight`` (see
    :mod:`prefixkv.engine.schedule_policy`); ``ValueError`` for anything else.
    """

    def __init__(
        self,
        kv: KVManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock: Callable[[], float],
        policy: str = "fcfs",
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock
        self.order = AdmissionOrder(policy, kv.cache, kv.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (at the back)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        queue = deque(self.running)
        self.running = []
        while queue and budget > 0:
            seq = queue.popleft()
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.grow(seq, seq.num_computed_tokens + num_new):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                self.running.append(seq)
                budget -= num_new
        self.running.extend(queue)  # out of budget this step; they keep their blocks
        if not out.preempted:
            budget = self._admit(out, budget)
        for seq in itertools.islice(self.waiting, PREFETCH_AHEAD):
            self.kv.prefetch(seq)  # still waiting after this step: read its blocks meanwhile
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        skipped: list[Sequence] = []
        admitted: list[Sequence] = []
        sharing = self.kv.cache is not None
        self.order.reorder(self.waiting)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            req = seq.request
            if sharing and (
                (seq.index > 0 and not req.prompt_prefilled) or self._shares_uncached(seq, admitted)
            ):
                skipped.append(self.waiting.popleft())  # next step its prefix will be cached
                continue
            num_new = self.kv.admit(seq, budget)
            if num_new is None:
                if not self.running:  # nothing will ever free more blocks for it
                    dead = self.waiting.popleft()
                    self.order.forget(dead)
                    dead.status = SequenceStatus.FINISHED
                    dead.finish_reason = "abort"
                    out.aborted.append(dead)
                    continue
                break
            self.waiting.popleft()
            self.order.forget(seq)
            seq.status = SequenceStatus.RUNNING
            if req.num_cached_tokens is None:
                req.num_cached_tokens = seq.num_computed_tokens
                req.num_external_queried_tokens, req.num_external_cached_tokens = seq.tier_tokens
                req.num_external_cached_tokens_by_tier = dict(seq.tier_loaded)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = self.clock()
            out.scheduled.append(ScheduledSeq(seq, num_new))
            self.running.append(seq)
            admitted.append(seq)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _shares_uncached(self, seq: Sequence, admitted: list[Sequence]) -> bool:
        """Whether ``seq`` shares at least ``MIN_SHARED_TOKENS`` (and a block) of prompt, not yet
        cached, with a sequence admitted earlier this step: then it waits one step and hits the
        blocks that sequence computes now, instead of computing them twice in one batch."""
        bs = self.kv.block_size
        need = max(bs, MIN_SHARED_TOKENS)
        tokens = seq.token_ids
        for other in admitted:
            if other.request.namespace != seq.request.namespace:
                continue
            cached = other.num_indexed_blocks * bs
            if _common_prefix(tokens, other.token_ids, bs, len(tokens) - 1) - cached >= need:
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.kv.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.order.note_preempted(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks and drop it from the queues."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.order.forget(seq)
        self.kv.release(seq)
        seq.status = SequenceStatus.FINISHED
