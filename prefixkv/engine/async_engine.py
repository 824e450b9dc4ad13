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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from typing import Any, Self, TypeVar

from prefixkv.cache.protocol import PinError, PinnedPrefix
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine.outputs import EngineStats, RequestOutput
from prefixkv.engine.prompts import PromptInput
from prefixkv.engine.sampling_params import SamplingParams

T = TypeVar("T")
_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncEngine:
    """Runs an :class:`LLMEngine` on a background thread; async, thread-safe methods on top."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: deque[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._sinks: dict[str, _Sink] = {}
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="prefixkv-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> AsyncEngine:
        """Build the engine like :class:`~prefixkv.engine.llm.LLM` (same arguments)."""
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
        return self._thread.is_alive() and self._error is None and not self._stopping

    # ------------------------------------------------------------- requests
    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: Hashable | None = None,
        lora_id: Hashable | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield a snapshot each step it changes, the last one finished."""
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def submit(engine: LLMEngine) -> None:
            if rid in self._sinks:
                raise ValueError(f"request_id {rid!r} is already running")
            engine.add_request(
                prompt, sampling_params, request_id=rid, cache_salt=cache_salt, lora_id=lora_id
            )
            self._sinks[rid] = (loop, queue)

        try:
            await self.call(submit)
        except asyncio.CancelledError:  # the submission may still land: take it back
            self._post(lambda e: self._abort(e, rid), None)
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
                self._post(lambda e: self._abort(e, rid), None)

    async def abort(self, request_id: str) -> bool:
        """Abort a request, freeing its blocks; ``False`` if it is unknown or already done.

        Its stream (if any) gets a final output with ``finish_reason="abort"``.
        """
        return await self.call(lambda e: self._abort(e, request_id))

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        out = engine.abort_request(request_id)
        if out is not None:
            self._dispatch([out])
        self._sinks.pop(request_id, None)
        return out is not None

    # ------------------------------------------------------------- admin (run between steps)
    async def get_stats(self) -> EngineStats:
        """Engine and cache statistics."""
        return await self.call(lambda e: e.get_stats())

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block not in use by a running request."""
        return await self.call(lambda e: e.reset_prefix_cache())

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
        _, ids = self.engine.tokenize(prompt)
        ns: dict[str, Any] = {"cache_salt": cache_salt, "lora_id": lora_id}
        error = PinError("prefix could not be pinned")
        for _attempt in range(2):  # the prefilled blocks may be evicted before the pin lands
            if not await self.call(lambda e: e.is_prefix_cached(ids, **ns)):
                params = SamplingParams(max_tokens=1, temperature=0.0)
                async for _ in self.generate({"prompt_token_ids": ids}, params, **ns):
                    pass
            try:
                return await self.call(lambda e: e.pin_prefix(ids, description=description, **ns))
            except PinError as exc:
                error = exc
        raise error

    async def unpin_prefix(
        self, prompt: PromptInput, *, cache_salt: Hashable | None = None, lora_id: Hashable | None = None
    ) -> bool:
        """Unpin a prefix pinned before; ``False`` if it was not pinned."""
        _, ids = self.engine.tokenize(prompt)
        return await self.call(lambda e: e.unpin_prefix(ids, cache_salt=cache_salt, lora_id=lora_id))

    async def list_pinned(self) -> list[PinnedPrefix]:
        """Pinned prefixes, oldest first."""
        return await self.call(lambda e: e.list_pinned())

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._post(fn, fut)
        return await asyncio.wrap_future(fut)

    def call_sync(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """Blocking :meth:`call` for code outside an event loop (never from the engine thread)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._post(fn, fut)
        return fut.result(timeout)

    # ------------------------------------------------------------- lifecycle
    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread; running streams end with ``RuntimeError``. Idempotent."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    def _post(
        self, fn: Callable[[LLMEngine], Any], fut: concurrent.futures.Future[Any] | None
    ) -> None:
        with self._wake:
            if self._stopping or self._error is not None:
                if fut is not None:
                    fut.set_exception(RuntimeError("the engine is not running", self._error))
                return
            self._commands.append((fn, fut if fut is not None else concurrent.futures.Future()))
            self._wake.notify()

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not (self._stopping or self._commands or engine.has_unfinished_requests()):
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(engine))
                        except BaseException as exc:  # noqa: BLE001 - handed to the caller
                            fut.set_exception(exc)
                if engine.has_unfinished_requests():
                    self._dispatch(engine.step())
        except BaseException as exc:  # noqa: BLE001 - a model failure: fail every stream, stop
            self._error = exc
        self._fail_all(self._error or RuntimeError("the engine was shut down"))

    def _dispatch(self, outs: Sequence[RequestOutput]) -> None:
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            loop, queue = sink
            if out.finished:
                del self._sinks[out.request_id]
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _fail_all(self, exc: BaseException) -> None:
        with self._wake:
            commands = list(self._commands)
            self._commands.clear()
            self._stopping = True
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the engine is not running"))
        for loop, queue in list(self._sinks.values()):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"engine stopped: {exc!r}"))
            except RuntimeError:
                pass
        self._sinks.clear()
