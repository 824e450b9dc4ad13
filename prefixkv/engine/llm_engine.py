"""LLMEngine: the synchronous core. ``step()`` = schedule -> run the model -> postprocess.

Not thread safe: one thread drives it (``LLM`` in the caller's thread, ``AsyncEngine`` on its
engine thread). It owns the scheduler, the KV manager (pool + prefix index), the requests, its
tokenizer and the output processor (text, stops, reports); the runner owns the model and the
KV tensors.

Failure isolation: when the model or the sampler raises in a step, the step is retried one
sequence at a time (K/V writes are idempotent: a sequence only writes its own private slots),
so only the request(s) that still fail alone end, with ``finish_reason="error"`` and
``RequestOutput.error``; their blocks are freed and every other request goes on.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from prefixkv.cache.protocol import PinnedPrefix
from prefixkv.config import EngineConfig
from prefixkv.engine.cache_admin import CacheAdmin
from prefixkv.engine.isolation import FaultHook, run_model_isolated, sample_isolated
from prefixkv.engine.kv_manager import KVManager, make_tier_store
from prefixkv.engine.lora import LoRARequest, make_registry, request_lora
from prefixkv.engine.output_processor import OutputProcessor
from prefixkv.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from prefixkv.engine.prompt_logprobs import PromptLogprobsRunner
from prefixkv.engine.prompts import PromptInput, render_chat, resolve_prompt
from prefixkv.engine.residency import make_observer
from prefixkv.engine.sampling import Pick, SeqSampler
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.scheduler import Scheduler
from prefixkv.engine.sequence import Request, SequenceStatus
from prefixkv.engine.sequence import Sequence as Seq
from prefixkv.engine.structured_output import GrammarCompiler
from prefixkv.models.tokenizer import IncrementalDetokenizer, Tokenizer
from prefixkv.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    """Requests in, :class:`RequestOutput` snapshots out, one step at a time.

    Args:
        runner: the model runner (owns the model and the KV tensors; its block size and
            context length are the engine's).
        config: every setting (:class:`~prefixkv.config.EngineConfig`); the engine reads its
            cache, scheduler and tier sections and ``model.seed``. ``None``: built from
            ``settings`` (flat names, as ``LLM(...)`` takes them) at the runner's block size;
            with a config, ``settings`` override it.
        tokenizer: the engine's tokenizer (prompts, detokenizing, stop strings); ``None``:
            the runner's.
        clock: time source for request timings.
        model_name: a display name (the model directory's name, or ``"prefixkv-demo"``).
    """

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.time,
        model_name: str = "model",
        **settings: Any,
    ) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(**{"block_size": runner.block_size, **settings})
        elif settings:
            config = config.replace(**settings)
        if config.cache.block_size != runner.block_size:
            raise ValueError(f"config.cache.block_size ({config.cache.block_size}) is not the "
                             f"runner's ({runner.block_size})")
        self.config = config
        self.runner = runner
        self.model_name = model_name
        self.tokenizer = tokenizer if tokenizer is not None else runner.tokenizer
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        self.clock = clock
        cc, sc = config.cache, config.scheduler
        cache = cc.make_index(runner.num_kv_blocks, runner.block_size)
        self.kv = KVManager(runner.num_kv_blocks, runner.block_size, cache, runner.copy_block_rows,
                            make_tier_store(config.tiers, runner, cc.max_cached_blocks_per_tenant),
                            make_observer(cc.kv_cache_metrics, cc.kv_cache_metrics_sample))
        # dropped without close() (or failing below): the tier / KV-event threads finish
        weakref.finalize(self, _release_threads, self.kv)
        if cc.kv_events_config is not None:
            from prefixkv.engine.kv_events_zmq import make_kv_event_sink

            self.kv.events = make_kv_event_sink(cc.kv_events_config, self.block_size)
        self.scheduler = Scheduler(self.kv, max_num_seqs=sc.max_num_seqs,
                                   max_num_batched_tokens=sc.max_num_batched_tokens, clock=clock,
                                   policy=sc.schedule_policy)
        eos = set(runner.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self._eos = frozenset(eos)
        self.sampler = SeqSampler(
            runner, config.model.seed, self._eos,
            lambda t: self.tokenizer.decode([t], skip_special_tokens=False)
        )
        self.output = OutputProcessor(
            lambda sp: IncrementalDetokenizer(self.tokenizer, skip_special_tokens=sp.skip_special_tokens)
            if sp.detokenize else None,
            self._eos, self.max_model_len)
        self._prompt_logprobs = PromptLogprobsRunner(
            runner, self.sampler, lambda: IncrementalDetokenizer(self.tokenizer))
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._counters = {"finished": 0, "prompt": 0, "cached": 0, "generated": 0, "steps": 0,
                          "failed": 0}
        self.fault_hook: FaultHook | None = None
        self.cache_admin = CacheAdmin(self.kv, cc.max_pinned_blocks_per_tenant)
        self.lora = make_registry(config.model, runner)  # None unless enable_lora
        self._max_chars: int | None = None

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Resolve a prompt to ``(text or None, token ids)``; ``ValueError`` if malformed or
        too long for the context. Thread safe (the tokenizer only).

        A text so long that even if every token covered the longest string in the vocabulary
        (twice over, for normalizers) it would not fit ``max_model_len`` is refused before
        it is tokenized: a 10 MB prompt costs a length check, not seconds of CPU.
        """
        return resolve_prompt(self.tokenizer, self.runner.config.vocab_size, prompt,
                              max_chars=self._max_prompt_chars())

    def _max_prompt_chars(self) -> int | None:
        if self._max_chars is None:
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None or not hasattr(backend, "get_vocab"):
                return None
            longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)
            self._max_chars = 2 * max(longest, 1) * self.max_model_len
        return self._max_chars

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
        lora_request: LoRARequest | str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id.

        Raises ``ValueError`` for a malformed prompt, a duplicate id, an unknown adapter, or a
        request that can never fit: prompt + max_tokens over ``max_model_len`` or more KV blocks
        than the pool. ``cache_salt`` / ``lora_id`` partition the prefix index (tenants never
        share blocks); a ``lora_request`` runs an adapter, its blocks keyed by its weights."""
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
        self._check_token_ids(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler()
            grammar.new_state(params.structured_outputs)  # ValueError now, not in the loop
        adapter, lora_id = request_lora(self.lora, lora_request, lora_id)
        now = self.clock() if arrival_time is None else arrival_time
        req = Request(rid, text, ids, params, max_tokens, request_namespace(cache_salt, lora_id),
                      RequestMetrics(now), lora=adapter)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        for i in range(params.n):  # everything that can fail happens before anything is queued
            sp = params.for_sample(i)
            seq = Seq(next(self._seq_ids), req, i, sp, list(ids), len(ids))
            seq.generator = self.sampler.generator_for(sp)
            if grammar is not None and sp.structured_outputs is not None:
                seq.grammar = grammar.new_state(sp.structured_outputs)
            req.seqs.append(seq)
        self.output.add(req)
        for seq in req.seqs:
            self.scheduler.add(seq)
        self._requests[rid] = req
        return rid

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.runner.config.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.bias]), ("allowed_token_ids", params.allowed),
                          ("logprob_token_ids", params.logprob_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): {bad}")

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this model (built on first use; the server
        prepares a request's grammar with it off the engine thread, so ``add_request`` copies)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer.backend.to_str(), self.runner.config.vocab_size, self._eos,
                self.config.model.constrained_json_disable_any_whitespace)
        return self._grammars

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (``None`` if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._finish_all(req, "abort")
        return self._finish_request(req)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the output of every request that changed (``finished`` marks the
        last); each output's deltas are since that request's previous one."""
        plan = self.scheduler.schedule()
        changed: dict[str, Request] = {}
        for seq in plan.aborted:  # can never fit: the whole request goes, with the reason
            req = seq.request
            pinned = self.kv.cache.get_stats().pinned_blocks if self.kv.cache is not None else 0
            req.error = (
                f"request cannot be scheduled: it needs more KV blocks than the pool can ever "
                f"free ({pinned} of its {self.kv.num_blocks} blocks are pinned)"
            )
            changed[req.request_id] = req
            self._finish_all(req, "abort")
        if plan.scheduled:
            self._counters["steps"] += 1
            seqs = [s.seq for s in plan.scheduled]
            fail = lambda seq, exc: self._fail(seq.request, exc, changed)
            ran, logits = run_model_isolated(
                self._prompt_logprobs.execute, seqs, [s.num_new_tokens for s in plan.scheduled],
                self.fault_hook, fail)
            rows, sampled = [], []
            for i, s in enumerate(plan.scheduled):
                seq = s.seq
                if i in ran and seq.num_computed_tokens + s.num_new_tokens == len(seq.token_ids):
                    rows.append(ran[i])
                    sampled.append(seq)
            new_token = sample_isolated(self.sampler, logits, rows, sampled, self.fault_hook, fail)
            now = self.clock()
            for i, s in enumerate(plan.scheduled):
                if i not in ran or s.seq.status is SequenceStatus.FINISHED:
                    continue  # failed this step (already reported) or finished with a sibling
                try:
                    self._postprocess(s.seq, s.num_new_tokens, new_token.get(id(s.seq)), now)
                except Exception as exc:  # noqa: BLE001 - e.g. detokenizing: fail it alone
                    self._fail(s.seq.request, exc, changed)
                    continue
                changed[s.seq.request.request_id] = s.seq.request
        outs = []
        for req in changed.values():
            if req.finished:
                self._requests.pop(req.request_id, None)
                outs.append(self._finish_request(req))
            else:
                outs.append(self.output.report(req))
        return outs

    def _fail(self, req: Request, exc: BaseException, changed: dict[str, Request]) -> None:
        """End ``req`` with ``finish_reason="error"``: its blocks are freed now."""
        if req.error is None:
            logger.warning("request %s failed: %r", req.request_id, exc, exc_info=exc)
            req.error = f"{type(exc).__name__}: {exc}"
            self._counters["failed"] += 1
        self._finish_all(req, "error")
        changed[req.request_id] = req

    def _finish_all(self, req: Request, reason: str) -> None:
        for seq in req.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                seq.finish_reason = reason
                self.scheduler.finish(seq)

    def fail_all_requests(self, exc: BaseException) -> list[RequestOutput]:
        """End every request with ``exc`` as its error (the engine loop's last resort when a
        step raised outside the per-request isolation); frees every block they hold."""
        changed: dict[str, Request] = {}
        for req in list(self._requests.values()):
            self._fail(req, exc, changed)
        self._requests.clear()
        return [self._finish_request(req) for req in changed.values()]

    def _postprocess(self, seq: Seq, num_new: int, pick: Pick | None, now: float) -> None:
        req = seq.request
        was_prefill = seq.is_prefill
        seq.num_computed_tokens += num_new
        if was_prefill:
            done = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            if seq.index == 0 and done == seq.num_prompt_tokens:
                req.prompt_prefilled = True
        self.kv.commit(seq)
        if pick is None:
            return
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        self.output.process_token(seq, pick.token_id, pick.logprobs)
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
        return self.output.finish(req)

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
            num_requests_failed=c["failed"],
            num_prompt_tokens=c["prompt"],
            num_cached_prompt_tokens=c["cached"],
            num_generated_tokens=c["generated"],
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=c["steps"],
            prefix_cache_hit_rate=c["cached"] / c["prompt"] if c["prompt"] else 0.0,
            cache=cache.get_stats() if cache is not None else None,
            tiers=self.kv.tier_stats(),
        )

    def close(self) -> None:
        """Finish queued writes to the disk/remote tiers and stop their threads (and the KV
        events'). Idempotent; the engine is still usable for the pool and host tier
        afterwards. An engine dropped without it is finalized by :func:`_release_threads`."""
        _release_threads(self.kv, wait=True)
        self.kv.events = None  # a closed sink takes no more records

    def reset_prefix_cache(self, tiers: str | Sequence[str] = "local") -> bool:
        """Drop every cached block not in use, and the lower tiers ``tiers`` names (``local``:
        the host tier; ``all``: also disk and remote); ``False`` with prefix caching off."""
        return self.cache_admin.reset(tiers) is not None

    def reset_prefix_cache_tiers(self, tiers: str | Sequence[str] = "local") -> dict[str, int | None] | None:
        """:meth:`reset_prefix_cache`, returning the blocks dropped per tier (``pool`` first;
        ``None`` with prefix caching off): :meth:`CacheAdmin.reset`."""
        return self.cache_admin.reset(tiers)

    def reset_prefix_cache_blocks(self) -> int | None:
        """Unpin everything and drop every cached block not in use; returns how many blocks
        went back to the pool (``None`` with prefix caching off)."""
        return self.cache_admin.reset_blocks()

    def is_prefix_cached(
        self, token_ids: Sequence[int], *, cache_salt: Hashable | None = None, lora_id: Hashable | None = None
    ) -> bool:
        """Whether every full block of ``token_ids`` is in the index (``ValueError`` if caching is off)."""
        return self.cache_admin.is_cached(token_ids, request_namespace(cache_salt, lora_id))

    def lookup_prefix(self, token_ids: Sequence[int], *, cache_salt: Hashable | None = None) -> dict[str, int]:
        """Where ``token_ids``' prefix is cached, per tier (:meth:`KVManager.lookup`)."""
        return self.cache_admin.lookup(token_ids, request_namespace(cache_salt, None))

    def prepare_pin(
        self, token_ids: Sequence[int], *, cache_salt: Hashable | None = None,
        lora_id: Hashable | None = None,
    ) -> bool:
        """:meth:`CacheAdmin.prepare_pin` in the request's namespace."""
        return self.cache_admin.prepare_pin(token_ids, request_namespace(cache_salt, lora_id))

    def pin_prefix(self, token_ids: Sequence[int], *, cache_salt: Hashable | None = None,
                   lora_id: Hashable | None = None, description: str | None = None) -> PinnedPrefix:
        """Pin the cached full blocks of ``token_ids`` (they must be cached: see ``LLM.pin_prefix``).

        Raises :class:`~prefixkv.cache.PinError` (a ``ValueError``) when not cached, shorter than
        a block or over the global or the tenant's pinned-block budget.
        """
        return self.cache_admin.pin(token_ids, request_namespace(cache_salt, lora_id), description)

    def unpin_prefix(
        self, token_ids: Sequence[int], *, cache_salt: Hashable | None = None, lora_id: Hashable | None = None
    ) -> bool:
        """Unpin a pinned prefix; ``False`` if it was not pinned."""
        return self.cache_admin.unpin(token_ids, request_namespace(cache_salt, lora_id))

    def list_pinned(self) -> list[PinnedPrefix]:
        """Pinned prefixes, oldest first (empty with prefix caching off)."""
        return self.cache_admin.list_pinned()


def request_namespace(cache_salt: Hashable | None, lora_id: Hashable | None) -> Hashable | None:
    """The index partition of a request (its prefix-cache namespace): ``None`` unless a salt or
    LoRA id is given; the engine, ``LLM`` and ``AsyncEngine`` key a request's blocks by it."""
    return None if cache_salt is None and lora_id is None else (cache_salt, lora_id)


def _release_threads(kv: KVManager, wait: bool = False) -> None:
    """Close ``kv``'s lower tiers and KV events sink: their threads finish their queues and end.
    :meth:`LLMEngine.close` waits for them; without ``wait`` this is a dropped engine's
    finalizer (also one whose construction failed after its tiers started), which must not
    block (interpreter exit waits for queued tier writes, ``prefixkv/tiers/writer.py``)."""
    if kv.tiers is not None:
        kv.tiers.close(wait=wait)
    if kv.events is not None:
        kv.events.close(wait=wait)
