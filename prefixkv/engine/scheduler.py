"""Scheduler: continuous batching under a token budget, with chunked prefill and preemption.

Each :meth:`Scheduler.schedule` call builds one step:

1. Running sequences first, oldest first: a decode takes 1 token of the budget, an unfinished
   prefill takes its next chunk. If the pool cannot cover a sequence's new tokens (even after
   evicting unlocked cached blocks), the newest running sequence is preempted by recompute:
   its blocks are released (indexed ones stay cached, now evictable) and it goes back to the
   front of the waiting queue, where re-admission finds its prefix in the cache.
2. If nothing was preempted, waiting sequences are admitted in arrival order while budget,
   ``max_num_seqs`` and blocks allow. Admission looks up the prefix first, so only uncached
   tokens cost budget. Sample ``i > 0`` of an ``n > 1`` request waits until sample 0 has
   prefilled the prompt, so the samples share the prompt's cached blocks.

A waiting sequence that cannot be admitted while nothing runs can never run (pinned blocks
fill the pool); it is finished with ``finish_reason="abort"`` instead of hanging.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixkv.engine.kv_manager import KVManager
from prefixkv.engine.sequence import Sequence, SequenceStatus


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
    """Owns the waiting and running queues; uses the :class:`KVManager` for blocks."""

    def __init__(
        self,
        kv: KVManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock: Callable[[], float],
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock = clock
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
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            req = seq.request
            if seq.index > 0 and not req.prompt_prefilled and self.kv.cache is not None:
                skipped.append(self.waiting.popleft())  # waits for sample 0's prompt blocks
                continue
            num_new = self.kv.admit(seq, budget)
            if num_new is None:
                if not self.running:  # nothing will ever free more blocks for it
                    dead = self.waiting.popleft()
                    dead.status = SequenceStatus.FINISHED
                    dead.finish_reason = "abort"
                    out.aborted.append(dead)
                    continue
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if req.num_cached_tokens is None:
                req.num_cached_tokens = seq.num_computed_tokens
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = self.clock()
            out.scheduled.append(ScheduledSeq(seq, num_new))
            self.running.append(seq)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.kv.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks and drop it from the queues."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.release(seq)
        seq.status = SequenceStatus.FINISHED
