"""AsyncEngine: the streaming entry point the server drives.

One background thread (the *engine thread*) owns an :class:`LLMEngine` and loops: run queued
commands, then one ``step()``, then hand each changed request's :class:`RequestOutput` to its
asyncio consumer. Everything that touches the engine (submission, abort, stats, pin, reset)
is a command run on that thread between steps, so callers on any event loop or thread are safe.

Usage (inside an event loop)::

    engine = AsyncEngine.from_args(model=None, block_size=16)   # model=None: the demo model
    prompt = engine.chat_prompt([{"role": "user", "content": "hi"}])  # or text / token ids
    async for out in engine.generate(prompt, SamplingParams(max_tokens=8), cache_salt="t1"):
        c = out.outputs[0]
        print(c.delta_text, end="")          # text added since the previous yield
    # out.finished; c.text / c.token_ids are cumulative; out.num_cached_tokens; out.metrics
    await engine.abort("req-id")             # frees the request's blocks (client went away)
    stats = await engine.get_stats()         # EngineStats (stats.cache: CacheStats or None)
    p = await engine.pin_prefix(token_ids_or_text, cache_salt=None, description="sys")
    await engine.unpin_prefix(token_ids_or_text); await engine.list_pinned()
    await engine.reset_prefix_cache()
    engine.shutdown()                        # stops the thread; pending streams get RuntimeError

``generate`` raises ``ValueError`` (from submission, before the first yield) for a bad prompt,
a duplicate ``request_id`` or a request that can never fit. Leaving the ``async for`` early
(break, cancellation, client disconnect) aborts the request. The final yield has
``finished=True`` and each sample's ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``).
A request that fails on its own (the model or sampler raised for it, or it can never be
scheduled) raises :class:`RequestFailedError` from the ``async for``; the engine goes on.

Prompts are tokenized (and chat templates rendered, via ``chat_prompt_async``) on a worker
thread, never on the engine thread or the event loop, so a huge prompt stalls neither the
running requests nor ``/health``.

The engine thread survives every failure it can attribute: a request's failure ends that
request (``LLMEngine`` isolates it). If a step raises outside that isolation, every request in
flight fails with the error and the loop goes on; only when that recovery itself raises, or
``MAX_CONSECUTIVE_STEP_FAILURES`` steps in a row raise, is the engine declared dead
(``is_running`` turns false and the server's ``/health`` answers 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Self, TypeVar

from prefixkv.cache.protocol import PinError, PinnedPrefix
from prefixkv.cache.retention import Retention
from prefixkv.engine.cache_admin import PIN_ATTEMPTS, PIN_PREFILL
from prefixkv.engine.lora import LoRARequest, request_lora
from prefixkv.engine.llm_engine import LLMEngine, request_namespace
from prefixkv.engine.outputs import EngineStats, RequestFailedError, RequestOutput
from prefixkv.engine.prompts import PromptInput
from prefixkv.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_CONSECUTIVE_STEP_FAILURES = 3
"""Steps in a row that may raise outside per-request isolation before the engine is dead."""
_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncEngine:
    """Runs an :class:`LLMEngine` on a background thread; async, thread-safe methods on top."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._core = _EngineLoop(engine)
        # dropped without shutdown(): the thread (which holds the loop, never this object)
        # stops, its streams end with RuntimeError, and the engine can be freed
        weakref.finalize(self, self._core.stop)

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> AsyncEngine:
        """Build the engine like :class:`~prefixkv.engine.llm.LLM` (same arguments: flat
        settings or ``config=EngineConfig(...)``)."""
        from prefixkv.engine.llm import build_engine

        return cls(build_engine(model, **kwargs))

    # ------------------------------------------------------------- read-only facts
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (thread safe for encode/decode/apply_chat_template)."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        """Display name of the model (``"prefixkv-demo"`` for the built-in demo model)."""
        return self.engine.model_name

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt; ``ValueError`` if malformed. Thread safe."""
        return self.engine.tokenize(prompt)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """A conversation rendered by the chat template, ready for :meth:`generate`:
        ``{"prompt": text, "prompt_token_ids": ids}``. ``ValueError`` on bad messages. Thread safe.
        """
        return self.engine.chat_prompt(messages, add_generation_prompt, **kwargs)

    async def chat_prompt_async(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """:meth:`chat_prompt` on a worker thread (keeps the event loop free)."""
        return await asyncio.to_thread(
            self.engine.chat_prompt, messages, add_generation_prompt, **kwargs
        )

    @property
    def max_model_len(self) -> int:
        """Context length of the model."""
        return self.engine.max_model_len

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the index's granularity)."""
        return self.engine.block_size

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and has not failed."""
        core = self._core
        return core.thread.is_alive() and core.error is None and not core.stopping

    # ------------------------------------------------------------- requests
    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: Hashable | None = None,
        lora_id: Hashable | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield a snapshot each step it changes, the last one finished
        (``lora_request``: its adapter, as :meth:`LLMEngine.add_request`)."""
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        text, ids = await asyncio.to_thread(self.engine.tokenize, prompt)
        resolved = {"prompt": text, "prompt_token_ids": ids}

        def submit(engine: LLMEngine) -> None:
            if rid in self._core.sinks:
                raise ValueError(f"request_id {rid!r} is already running")
            engine.add_request(resolved, sampling_params, request_id=rid, cache_salt=cache_salt,
                               lora_id=lora_id, lora_request=lora_request)
            self._core.sinks[rid] = (loop, queue)

        try:
            await self.call(submit)
        except asyncio.CancelledError:  # the submission may still land: take it back
            self._core.post(lambda e: self._abort(e, rid), None)
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._core.post(lambda e: self._abort(e, rid), None)

    async def abort(self, request_id: str) -> bool:
        """Abort a request, freeing its blocks; ``False`` if it is unknown or already done.

        Its stream (if any) gets a final output with ``finish_reason="abort"``.
        """
        return await self.call(lambda e: self._abort(e, request_id))

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        out = engine.abort_request(request_id)
        if out is not None:
            self._core.dispatch([out])
        self._core.sinks.pop(request_id, None)
        return out is not None

    # ------------------------------------------------------------- admin (run between steps)
    async def get_stats(self) -> EngineStats:
        """Engine and cache statistics."""
        return await self.call(lambda e: e.get_stats())

    async def reset_prefix_cache(self, tiers: str | Sequence[str] = "local") -> bool:
        """Drop every cached block not in use by a running request (and the lower tiers
        ``tiers`` names: ``LLMEngine.reset_prefix_cache``)."""
        return await self.call(lambda e: e.reset_prefix_cache(tiers))

    async def reset_prefix_cache_tiers(self, tiers: str | Sequence[str] = "local") -> dict[str, int | None] | None:
        """:meth:`reset_prefix_cache`, returning the blocks dropped per tier (``None``: caching off)."""
        return await self.call(lambda e: e.reset_prefix_cache_tiers(tiers))

    async def reset_prefix_cache_blocks(self) -> int | None:
        """:meth:`reset_prefix_cache`, returning the blocks freed (``None``: caching off)."""
        return await self.call(lambda e: e.reset_prefix_cache_blocks())

    async def pin_prefix(
        self,
        prompt: PromptInput,
        *,
        cache_salt: Hashable | None = None,
        lora_id: Hashable | None = None,
        description: str | None = None,
    ) -> PinnedPrefix:
        """Pin a prefix (text or token ids), prefilling it first if it is not cached.

        Raises ``ValueError`` (:class:`PinError`) when it cannot be pinned: prefix caching off,
        shorter than a block, or over the pinned-block budget.
        """
        _, ids = await asyncio.to_thread(self.engine.tokenize, prompt)
        ns: dict[str, Any] = {"cache_salt": cache_salt, "lora_id": lora_id}
        error: PinError | None = None
        for _attempt in range(PIN_ATTEMPTS):  # the same steps as LLM.pin_prefix
            if await self.call(lambda e: e.prepare_pin(ids, **ns)):
                async for _ in self.generate({"prompt_token_ids": ids}, PIN_PREFILL, **ns):
                    pass
            try:
                return await self.call(lambda e: e.pin_prefix(ids, description=description, **ns))
            except PinError as exc:
                error = exc
        assert error is not None
        raise error

    async def retain_prefix(
        self, prompt: PromptInput, retention: Retention, *, cache_salt: Hashable | None = None,
        lora_id: Hashable | None = None,
    ) -> int:
        """Soft-retain a prefix (text or token ids) as :meth:`LLM.retain_prefix` does: a 1-token
        request carrying ``retention``, then the retention of its full blocks in every tier;
        returns how many blocks are retained. :class:`~prefixkv.cache.RetentionError` past the
        tenant's quota; ``ValueError`` with prefix caching off."""
        _, ids = await asyncio.to_thread(self.engine.tokenize, prompt)
        await self.call(lambda e: e.kv.require_cache())
        async for _ in self.generate({"prompt_token_ids": ids},
                                     replace(PIN_PREFILL, retention=retention),
                                     cache_salt=cache_salt, lora_id=lora_id):
            pass
        ns = request_namespace(cache_salt, lora_id)
        return await self.call(lambda e: e.cache_admin.retain(ids, ns, retention))

    async def retain_cached_prefix(
        self, token_ids: Sequence[int], retention: Retention, *, cache_salt: Hashable | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> int:
        """``CacheAdmin.retain`` in a request's namespace (its adapter resolved as
        ``add_request`` does): the cached full blocks of ``token_ids``, nothing computed;
        returns how many are retained. ``RetentionError`` past the tenant's quota."""
        ids = list(token_ids)

        def keep(e: LLMEngine) -> int:
            _, lora_id = request_lora(e.lora, lora_request, None)
            return e.cache_admin.retain(ids, request_namespace(cache_salt, lora_id), retention)

        return await self.call(keep)

    async def unpin_prefix(
        self, prompt: PromptInput, *, cache_salt: Hashable | None = None, lora_id: Hashable | None = None
    ) -> bool:
        """Unpin a prefix pinned before; ``False`` if it was not pinned."""
        _, ids = await asyncio.to_thread(self.engine.tokenize, prompt)
        return await self.call(lambda e: e.unpin_prefix(ids, cache_salt=cache_salt, lora_id=lora_id))

    async def lookup_prefix(self, prompt: PromptInput, *, cache_salt: Hashable | None = None
                            ) -> tuple[int, dict[str, int]]:
        """The prompt's token count and where its prefix is cached (:meth:`LLMEngine.lookup_prefix`)."""
        _, ids = await asyncio.to_thread(self.engine.tokenize, prompt)
        return len(ids), await self.call(lambda e: e.lookup_prefix(ids, cache_salt=cache_salt))

    async def list_pinned(self) -> list[PinnedPrefix]:
        """Pinned prefixes, oldest first."""
        return await self.call(lambda e: e.list_pinned())

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._core.post(fn, fut)
        return await asyncio.wrap_future(fut)

    def call_sync(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """Blocking :meth:`call` for code outside an event loop (never from the engine thread)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._core.post(fn, fut)
        return fut.result(timeout)

    # ------------------------------------------------------------- lifecycle
    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread; running streams end with ``RuntimeError``. Idempotent.
        An ``AsyncEngine`` dropped without it stops the same way (a finalizer), without waiting."""
        self._core.stop()
        if threading.current_thread() is not self._core.thread:
            self._core.thread.join(timeout)
            self.engine.close()  # queued disk/remote tier writes finish; their threads stop

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()


class _EngineLoop:
    """The engine thread and what it shares with callers: the command queue, the streams'
    sinks, the stop flag and the error that ended it. The thread holds this object and the
    :class:`LLMEngine`, never the :class:`AsyncEngine` (so dropping that stops the thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.commands: deque[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]]] = deque()
        self.wake = threading.Condition()
        self.sinks: dict[str, _Sink] = {}
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name="prefixkv-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Ask the thread to stop after the command or step it is running; does not wait for it."""
        with self.wake:
            self.stopping = True
            self.wake.notify()

    def post(
        self, fn: Callable[[LLMEngine], Any], fut: concurrent.futures.Future[Any] | None
    ) -> None:
        with self.wake:
            if self.stopping or self.error is not None:
                if fut is not None:
                    fut.set_exception(RuntimeError("the engine is not running", self.error))
                return
            self.commands.append((fn, fut if fut is not None else concurrent.futures.Future()))
            self.wake.notify()

    def run(self) -> None:
        engine = self.engine
        failures = 0
        try:
            while True:
                with self.wake:
                    while not (self.stopping or self.commands or engine.has_unfinished_requests()):
                        self.wake.wait()
                    if self.stopping:
                        break
                    commands = list(self.commands)
                    self.commands.clear()
                _run_commands(engine, commands)
                del commands  # (a command's closure may hold the AsyncEngine: not while idle)
                if engine.has_unfinished_requests():
                    try:
                        outs = engine.step()
                        failures = 0
                    except Exception as exc:
                        failures += 1
                        logger.exception("engine step failed (%d in a row)", failures)
                        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                            raise
                        outs = engine.fail_all_requests(exc)  # raising here ends the engine
                    self.dispatch(outs)
        except BaseException as exc:  # noqa: BLE001 - unrecoverable: fail every stream, stop
            logger.critical("the engine thread stopped: %r", exc)
            self.error = exc
        self.fail_all(self.error or RuntimeError("the engine was shut down"))

    def dispatch(self, outs: Sequence[RequestOutput]) -> None:
        for out in outs:
            sink = self.sinks.get(out.request_id)
            if sink is None:
                continue
            loop, queue = sink
            item: RequestOutput | BaseException = out
            if out.finished:
                del self.sinks[out.request_id]
                if out.error is not None:
                    caused = any(o.finish_reason == "error" for o in out.outputs)
                    item = RequestFailedError(out.request_id, out.error, request_caused=caused)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def fail_all(self, exc: BaseException) -> None:
        with self.wake:
            commands = list(self.commands)
            self.commands.clear()
            self.stopping = True
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the engine is not running"))
        for loop, queue in list(self.sinks.values()):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"engine stopped: {exc!r}"))
            except RuntimeError:
                pass
        self.sinks.clear()


def _run_commands(
    engine: LLMEngine,
    commands: list[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]]],
) -> None:
    for fn, fut in commands:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
