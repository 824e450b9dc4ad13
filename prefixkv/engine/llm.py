"""LLM: the offline, synchronous API (vLLM's ``LLM``), driven in the caller's thread.

    llm = LLM()                                   # the built-in demo model (meaningless text)
    llm = LLM("smollm2-135m-instruct")            # a real model, fetched once (~93 MB)
    llm = LLM("path/to/model.gguf")               # or a GGUF file, or an HF directory
    llm = LLM(config=EngineConfig.from_kwargs(block_size=16, max_num_seqs=8))
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
    outs[0].outputs[0].text, outs[0].num_cached_tokens, outs[0].metrics.time_to_first_token
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefixkv.cache.protocol import CacheStats, PinError, PinnedPrefix
from prefixkv.cache.retention import Retention
from prefixkv.config import EngineConfig, parse_size
from prefixkv.engine.cache_admin import PIN_ATTEMPTS, PIN_PREFILL
from prefixkv.engine.lora import LoRARequest
from prefixkv.engine.llm_engine import LLMEngine, request_namespace
from prefixkv.engine.outputs import EngineStats, RequestOutput
from prefixkv.engine.prompts import PromptInput, template_options
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.models.loader import load_tokenizer
from prefixkv.models.tokenizer import Tokenizer
from prefixkv.runner import cpu_malloc
from prefixkv.runner.model_runner import ModelRunner

Messages = Sequence[Mapping[str, Any]]


def build_engine(
    model: str | Path | None = None, *, config: EngineConfig | None = None, **kwargs: Any
) -> LLMEngine:
    """Load the model and build an :class:`LLMEngine` from one :class:`EngineConfig`.

    Give ``config``, or flat settings (``block_size=16, max_num_seqs=32, ...``: every name in
    :data:`prefixkv.config.OPTIONS`, vLLM's where vLLM has one) that build it; both: the
    settings override the config's. An unknown name is a ``TypeError`` naming it, a bad value
    a ``ValueError`` naming it, both before anything loads.

    ``model``: ``None`` (the built-in demo model), an HF-format directory, a ``.gguf`` file, or
    a name from :data:`prefixkv.models.catalog.CATALOG` (``"smollm2-135m-instruct"``, fetched
    into the cache directory on first use). The engine's tokenizer is the model's (or
    ``tokenizer``'s directory), with ``chat_template`` (a file or the template text) if given.
    """
    if config is None:
        config = EngineConfig.from_kwargs(model, **kwargs)
    elif model is not None or kwargs:
        config = config.replace(**({"model": model} if model is not None else {}), **kwargs)
    m, c = config.model, config.cache
    if m.model is None:
        from prefixkv.models.demo import ensure_demo_model

        path, name = ensure_demo_model(), "prefixkv-demo"
    else:
        from prefixkv.models.catalog import resolve_model

        name = Path(m.model).name or str(m.model)
        path = resolve_model(m.model)
    runner = ModelRunner(path, block_size=c.block_size, num_kv_blocks=c.num_kv_blocks,
                         kv_cache_memory_bytes=c.kv_cache_memory, device=m.device, dtype=m.dtype,
                         max_model_len=m.max_model_len, tokenizer=m.tokenizer, threads=m.threads,
                         quantization=m.quantization)
    if m.tune_malloc and runner.device.type == "cpu":
        cpu_malloc.tune()  # process-wide (runner/cpu_malloc.py)
    tokenizer = load_tokenizer(path if m.tokenizer is None else m.tokenizer)
    if m.chat_template is not None:
        tokenizer = _with_template(tokenizer, m.chat_template)
    return LLMEngine(runner, config, tokenizer=tokenizer, model_name=name)


def _with_template(tok: Tokenizer, template: str | Path) -> Tokenizer:
    """``tok`` with another chat template (a file path or the template text)."""
    path = Path(template)
    text = path.read_text(encoding="utf-8") if len(str(template)) < 4096 and path.is_file() else str(template)
    return Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=text)


class _TurnLock:
    """A lock granted in the order it was asked for (tickets): a thread that steps the engine
    over and over cannot take it again ahead of a thread already waiting (``threading.Lock``
    may hand it straight back to the releasing thread, holding a short call behind a long one).
    A waiter interrupted (``KeyboardInterrupt``) gives up its turn and blocks no one."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket that holds the lock (or may take it)
        self._abandoned: set[int] = set()

    def __enter__(self) -> None:
        with self._cv:
            ticket = self._next
            self._next += 1
            try:
                while ticket != self._serving:
                    self._cv.wait()
            except BaseException:
                if ticket == self._serving:  # its turn came as it was interrupted: pass it on
                    self._serving += 1
                else:
                    self._abandoned.add(ticket)
                self._pass_on()
                raise

    def __exit__(self, *exc_info: object) -> None:
        with self._cv:
            self._serving += 1
            self._pass_on()

    def _pass_on(self) -> None:
        while self._serving in self._abandoned:
            self._abandoned.remove(self._serving)
            self._serving += 1
        self._cv.notify_all()


class LLM:
    """Offline generation with prefix caching. Arguments as :func:`build_engine`:
    ``LLM(model, **settings)`` or ``LLM(config=EngineConfig(...))``.

    Thread safe: calls from several threads share the engine (one thread steps it at a time,
    under ``_lock``, taken in turn), so their requests are batched together and each call
    returns its own outputs; a request that finishes in another thread's step is parked for its
    caller. For an
    asyncio server use :class:`~prefixkv.engine.async_engine.AsyncEngine`.

    With disk / remote KV tiers or KV events it runs background threads: :meth:`close` (or
    leaving a ``with LLM(...) as llm:`` block) writes what is queued and stops them; an ``LLM``
    dropped without it lets them finish on their own, and interpreter exit waits for queued tier
    writes, so a script's disk tier is complete when it ends.
    """

    def __init__(
        self, model: str | Path | None = None, *, config: EngineConfig | None = None, **kwargs: Any
    ) -> None:
        self._attach(build_engine(model, config=config, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An ``LLM`` over an engine built elsewhere (e.g. a second engine on the same
        ``ModelRunner``: ``LLM.from_engine(LLMEngine(llm.engine.runner, ...))``, one model in
        memory). The engine is then this ``LLM``'s: do not step it from elsewhere."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = _TurnLock()  # held for every call into the engine (one thread's state)
        self._parked: dict[str, RequestOutput] = {}  # finished in a step another caller ran

    def close(self) -> None:
        """Finish the lower tiers' queued writes and stop the background threads. Idempotent;
        generation still works afterwards, with the pool and the host tier only."""
        with self._lock:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        cache_salt: Hashable | None = None,
        lora_id: Hashable | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list; results in input order, all finished.

        A prompt is text, a list of token ids, or ``{"prompt_token_ids": [...]}`` /
        ``{"prompt": "..."}``. ``sampling_params`` is one for all or one per prompt. A bad
        prompt or a request that can never fit raises ``ValueError`` before anything runs.
        ``lora_request`` (vLLM's; with ``enable_lora``): one adapter for all, or one per prompt
        (``None`` entries run the base model); a ``LoRARequest`` or a loaded adapter's name.
        """
        batch = _as_batch(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(batch):
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries for {len(batch)} prompts"
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(batch)
        loras = (list(lora_request) if isinstance(lora_request, Sequence)
                 and not isinstance(lora_request, (str, LoRARequest)) else [lora_request] * len(batch))
        if len(loras) != len(batch):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(batch)} prompts")
        ids: list[str] = []
        with self._lock:
            try:
                for p, sp, lora in zip(batch, params_list, loras):
                    ids.append(self.engine.add_request(p, sp, cache_salt=cache_salt,
                                                       lora_id=lora_id, lora_request=lora))
            except ValueError:
                for rid in ids:
                    self.engine.abort_request(rid)
                raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        cache_salt: Hashable | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them;
        ``continue_final_message`` (with ``add_generation_prompt=False``) continues the last
        message instead of starting a new turn."""
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of messages or conversations")
        convs: list[Any] = [messages] if isinstance(messages[0], Mapping) else list(messages)
        options = template_options(chat_template_kwargs, add_generation_prompt, continue_final_message)
        prompts: list[PromptInput] = [
            self.engine.chat_prompt(c, **options)
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm, cache_salt=cache_salt)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        wanted = set(ids)
        try:
            while len(done) < len(wanted):
                with self._lock:
                    before = len(done)
                    if self._parked:  # finished in another caller's step (empty when alone)
                        for rid in [r for r in self._parked if r in wanted]:
                            done[rid] = self._parked.pop(rid)
                    if len(done) < len(wanted):
                        if not self.engine.has_unfinished_requests():
                            raise RuntimeError("requests lost by the engine")
                        for out in self.engine.step():
                            if out.finished:
                                if out.request_id in wanted:
                                    done[out.request_id] = out
                                else:
                                    self._parked[out.request_id] = out
                if bar is not None:
                    bar.update(len(done) - before)
        except BaseException:
            with self._lock:
                for rid in wanted - done.keys():
                    self._parked.pop(rid, None)
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in ids]

    # ------------------------------------------------------------------ cache admin
    def reset_prefix_cache(self, tiers: str | Sequence[str] = "local") -> bool:
        """Drop every cached block (``False`` with prefix caching off), and the lower KV tiers
        ``tiers`` names: ``local`` (default: the host tier), ``all`` (also the disk and the
        shared remote tier), ``none``, or names like ``"host,disk"`` (docs/tiers.md)."""
        with self._lock:
            return self.engine.reset_prefix_cache(tiers)

    def get_cache_stats(self) -> CacheStats | None:
        """The prefix index's statistics (``None`` with prefix caching off)."""
        return self.get_stats().cache

    def get_stats(self) -> EngineStats:
        """Engine statistics: queues, KV blocks, counters, and the index's stats."""
        with self._lock:
            return self.engine.get_stats()

    def pin_prefix(
        self, prompt: PromptInput, *, cache_salt: Hashable | None = None, description: str | None = None
    ) -> PinnedPrefix:
        """Pin a prefix, prefilling it first (``max_tokens=1``) if it is not cached yet.

        Raises ``ValueError`` (``PinError``) if it cannot be pinned; a pin that the budget
        refuses is refused before anything is computed (``LLMEngine.prepare_pin``).
        """
        _, ids = self.engine.tokenize(prompt)
        error: PinError | None = None
        for _attempt in range(PIN_ATTEMPTS):
            with self._lock:
                prefill = self.engine.prepare_pin(ids, cache_salt=cache_salt)
            if prefill:
                self.generate({"prompt_token_ids": ids}, PIN_PREFILL, cache_salt=cache_salt)
            try:
                with self._lock:
                    return self.engine.pin_prefix(ids, cache_salt=cache_salt,
                                                  description=description)
            except PinError as exc:  # evicted between the prefill and the pin: once more
                error = exc
        assert error is not None
        raise error

    def retain_prefix(self, prompt: PromptInput, retention: Retention, *,
                      cache_salt: Hashable | None = None) -> int:
        """Soft-retain a prefix (docs/cache.md, "Retention"): one 1-token request carrying
        ``retention`` computes what is not cached, then its full blocks are retained in the
        pool and every lower tier; returns how many. :class:`~prefixkv.cache.RetentionError`
        (a ``ValueError``) past the tenant's quota; ``ValueError`` with prefix caching off."""
        _, ids = self.engine.tokenize(prompt)
        self.engine.kv.require_cache()
        self.generate({"prompt_token_ids": ids}, replace(PIN_PREFILL, retention=retention),
                      cache_salt=cache_salt)
        with self._lock:
            return self.engine.cache_admin.retain(ids, request_namespace(cache_salt, None), retention)

    def unpin_prefix(self, prompt: PromptInput, *, cache_salt: Hashable | None = None) -> bool:
        """Unpin a pinned prefix; ``False`` if it was not pinned."""
        _, ids = self.engine.tokenize(prompt)
        with self._lock:
            return self.engine.unpin_prefix(ids, cache_salt=cache_salt)

    def list_pinned(self) -> list[PinnedPrefix]:
        """Pinned prefixes, oldest first."""
        with self._lock:
            return self.engine.list_pinned()


def _as_batch(prompts: Any) -> list[PromptInput]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt of token ids (validated at submission)
    if isinstance(prompts, Sequence) and prompts:
        return list(prompts)
    raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, got {prompts!r}")


__all__ = ["LLM", "build_engine", "parse_size"]
