"""LLMEngine: the synchronous core. ``step()`` = schedule -> run the model -> postprocess.

Not thread safe: one thread drives it (``LLM`` in the caller's thread, ``AsyncEngine`` on its
engine thread). It owns the scheduler, the KV manager (pool + prefix index) and the requests;
the runner owns the model and the KV tensors.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from prefixkv.cache import make_cache
from prefixkv.cache.protocol import PinnedPrefix
from prefixkv.engine.kv_manager import KVManager
from prefixkv.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from prefixkv.engine.prompts import PromptInput, render_chat, resolve_prompt
from prefixkv.engine.sampling import SeqSampler
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.scheduler import Scheduler
from prefixkv.engine.sequence import Request, SequenceStatus
from prefixkv.engine.sequence import Sequence as Seq
from prefixkv.models.tokenizer import IncrementalDetokenizer
from prefixkv.runner.model_runner import ModelRunner, RunItem


class LLMEngine:
    """Requests in, :class:`RequestOutput` snapshots out, one step at a time.

    Args:
        runner: the model runner (owns model, tokenizer and KV tensors).
        enable_prefix_caching: with ``False`` there is no index: blocks go straight back to the
            pool when a request finishes.
        index / eviction_policy / hash_algo / max_pinned_blocks: the prefix index
            (``make_cache``); its block size is the runner's.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one step (prefill chunk size).
        seed: seeds the generator of unseeded sampling requests.
        clock: time source for request timings.
        model_name: a display name (the model directory's name, or ``"prefixkv-demo"``).
        schedule_policy: admission order of waiting requests (``fcfs``, ``lpm``, ``dfs-weight``).
    """

    def __init__(
        self,
        runner: ModelRunner,
        *,
        enable_prefix_caching: bool = True,
        index: str = "radix",
        eviction_policy: str = "lru",
        hash_algo: str = "sha256",
        max_pinned_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        model_name: str = "model",
        schedule_policy: str = "fcfs",
    ) -> None:
        self.runner = runner
        self.model_name = model_name
        self.tokenizer = runner.tokenizer
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        self.clock = clock
        cache = None
        if enable_prefix_caching:
            cache = make_cache(
                index=index,
                max_blocks=runner.num_kv_blocks,
                block_size=runner.block_size,
                eviction_policy=eviction_policy,
                hash_algo=hash_algo,
                max_pinned_blocks=max_pinned_blocks,
            )
        self.kv = KVManager(runner.num_kv_blocks, runner.block_size, cache, runner.copy_block_rows)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            clock=clock,
            policy=schedule_policy,
        )
        self.sampler = SeqSampler(runner, seed)
        eos = set(runner.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self._eos = frozenset(eos)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._counters = {"finished": 0, "prompt": 0, "cached": 0, "generated": 0, "steps": 0}

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Resolve a prompt to ``(text or None, token ids)``; ``ValueError`` if malformed."""
        return resolve_prompt(self.tokenizer, self.runner.config.vocab_size, prompt)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """A conversation rendered by the chat template: ``{"prompt", "prompt_token_ids"}``."""
        return render_chat(self.tokenizer, messages, add_generation_prompt, **kwargs)

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: Hashable | None = None,
        lora_id: Hashable | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id.

        Raises ``ValueError`` for a malformed prompt, a duplicate id, or a request that can
        never fit: prompt + max_tokens over ``max_model_len`` or more KV blocks than the pool.
        ``cache_salt`` / ``lora_id`` partition the prefix index (tenants never share blocks).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")  # noqa: TRY004
        text, ids = self.tokenize(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already running")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len {self.max_model_len} leaves no room"
            )
        # max_tokens=None: as many as the context and (for one sequence alone) the pool allow
        pool_room = self.kv.num_blocks * self.block_size - len(ids) + 1
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, min(room, pool_room))
        if max_tokens > room:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        need = self.kv.blocks_for(len(ids) + max_tokens - 1)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks; "
                f"the pool has {self.kv.num_blocks}"
            )
        namespace = _namespace(cache_salt, lora_id)
        now = self.clock() if arrival_time is None else arrival_time
        req = Request(rid, text, ids, params, max_tokens, namespace, RequestMetrics(now))
        for i in range(params.n):
            sp = params.for_sample(i)
            seq = Seq(next(self._seq_ids), req, i, sp, list(ids), len(ids))
            seq.generator = self.sampler.generator_for(sp)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=sp.skip_special_tokens
            )
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self._requests[rid] = req
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (``None`` if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return self._finish_request(req)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns a snapshot of every request that changed (``finished`` marks the last)."""
        plan = self.scheduler.schedule()
        changed: dict[str, Request] = {}
        for seq in plan.aborted:  # can never fit: the whole request goes
            changed[seq.request.request_id] = seq.request
            for sib in seq.request.seqs:
                if sib.status is not SequenceStatus.FINISHED:
                    sib.finish_reason = "abort"
                    self.scheduler.finish(sib)
        if plan.scheduled:
            self._counters["steps"] += 1
            items = [
                RunItem(
                    s.seq.token_ids[s.seq.num_computed_tokens : s.seq.num_computed_tokens + s.num_new_tokens],
                    s.seq.num_computed_tokens,
                    s.seq.block_table,
                )
                for s in plan.scheduled
            ]
            logits = self.runner.execute(items)
            rows, sampled = [], []
            for i, s in enumerate(plan.scheduled):
                seq = s.seq
                if seq.num_computed_tokens + s.num_new_tokens == len(seq.token_ids):
                    rows.append(i)
                    sampled.append(seq)
            tokens = self.sampler.sample(logits, rows, sampled) if rows else []
            new_token = dict(zip((id(s) for s in sampled), tokens))
            now = self.clock()
            for s in plan.scheduled:
                self._postprocess(s.seq, s.num_new_tokens, new_token.get(id(s.seq)), now)
                changed[s.seq.request.request_id] = s.seq.request
        outs = []
        for req in changed.values():
            if req.finished:
                self._requests.pop(req.request_id, None)
                outs.append(self._finish_request(req))
            else:
                outs.append(req.snapshot())
        return outs

    def _postprocess(self, seq: Seq, num_new: int, token: int | None, now: float) -> None:
        req = seq.request
        was_prefill = seq.is_prefill
        seq.num_computed_tokens += num_new
        if was_prefill:
            done = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            if seq.index == 0 and done == seq.num_prompt_tokens:
                req.prompt_prefilled = True
        self.kv.commit(seq)
        if token is None:
            return
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        seq.append_token(token, self._eos, self.max_model_len)
        self._counters["generated"] += 1
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    # ------------------------------------------------------------------ outputs
    def _finish_request(self, req: Request) -> RequestOutput:
        req.metrics.finished_time = self.clock()
        c = self._counters
        c["finished"] += 1
        c["prompt"] += len(req.prompt_token_ids)
        c["cached"] += req.num_cached_tokens or 0
        return req.snapshot()

    # ------------------------------------------------------------------ cache admin
    def get_stats(self) -> EngineStats:
        """Queues, KV blocks, counters and the index's stats."""
        cache = self.kv.cache
        c = self._counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.pool.num_free,
            num_cached_blocks=cache.num_cached_blocks if cache is not None else 0,
            num_evictable_blocks=cache.num_evictable_blocks if cache is not None else 0,
            block_size=self.block_size,
            enable_prefix_caching=cache is not None,
            num_requests_finished=c["finished"],
            num_prompt_tokens=c["prompt"],
            num_cached_prompt_tokens=c["cached"],
            num_generated_tokens=c["generated"],
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=c["steps"],
            prefix_cache_hit_rate=c["cached"] / c["prompt"] if c["prompt"] else 0.0,
            cache=cache.get_stats() if cache is not None else None,
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block not in use; ``False`` with prefix caching off."""
        if self.kv.cache is None:
            return False
        self.kv.reset_cache()
        return True

    def is_prefix_cached(
        self, token_ids: Sequence[int], *, cache_salt: Hashable | None = None, lora_id: Hashable | None = None
    ) -> bool:
        """Whether every full block of ``token_ids`` is in the index (``ValueError`` if caching is off)."""
        return self.kv.is_cached(list(token_ids), _namespace(cache_salt, lora_id))

    def pin_prefix(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: Hashable | None = None,
        lora_id: Hashable | None = None,
        description: str | None = None,
    ) -> PinnedPrefix:
        """Pin the cached full blocks of ``token_ids`` (they must be cached: see ``LLM.pin_prefix``).

        Raises :class:`~prefixkv.cache.PinError` (a ``ValueError``) when not cached, shorter than
        a block or over the pinned-block budget.
        """
        return self.kv.pin(list(token_ids), _namespace(cache_salt, lora_id), description)

    def unpin_prefix(
        self, token_ids: Sequence[int], *, cache_salt: Hashable | None = None, lora_id: Hashable | None = None
    ) -> bool:
        """Unpin a pinned prefix; ``False`` if it was not pinned."""
        return self.kv.unpin(list(token_ids), _namespace(cache_salt, lora_id))

    def list_pinned(self) -> list[PinnedPrefix]:
        """Pinned prefixes, oldest first (empty with prefix caching off)."""
        return [] if self.kv.cache is None else list(self.kv.cache.list_pinned())


def _namespace(cache_salt: Hashable | None, lora_id: Hashable | None) -> Hashable | None:
    """The index partition of a request: ``None`` unless a salt or LoRA id is given."""
    return None if cache_salt is None and lora_id is None else (cache_salt, lora_id)
