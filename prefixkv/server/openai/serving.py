"""Owns: ``OpenAIServing``: completions and chat on the engine (every chat-based dialect's path).
Imports: prefixkv.engine, the server core, this package's protocol, render, request_params, tools.

The OpenAI completions and chat completions endpoints, on top of ``AsyncEngine``.

One HTTP request becomes one engine request per prompt (a completions batch has several); the
engine's ``n`` samples of a prompt become choices ``prompt_index * n + sample_index``.

Lifetime: a submission error (a prompt too long for the context or the KV pool, a bad
sampling value, ``n`` or a batch over ``ServerLimits``) is found before anything is queued
and answered as a 400. After that, the engine requests belong to the response: when it ends
early (a client that disconnects mid-stream, a cancelled handler) every unfinished engine
request is aborted, which frees its KV blocks. A request that fails in the engine is a 500
marked request-caused (``X-Prefixkv-Error-Cause: request``) or, if it can never get KV room,
a 503; streamed, it ends with an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.engine.outputs import RequestOutput
from prefixkv.engine.prompts import template_options
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.server.errors import APIError
from prefixkv.server.limits import ServerLimits, check_prompt_chars
from prefixkv.server.lora_routes import adapter_of
from prefixkv.server.metrics import ServerMetrics
from prefixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from prefixkv.server.openai.render import ChoiceRenderer
from prefixkv.server.openai.request_params import retention_of, sampling_params
from prefixkv.server.openai.tools import output_constraint
from prefixkv.server.streaming import (Disconnected, EngineStreamingResponse, engine_failure,
                                       finish_unless_gone, sse)
from prefixkv.server.tracing import RequestTrace, RequestTracer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``; chat's is ``ServerLimits.default_chat_max_tokens``
(capped by the room left in the context)."""


def _param_of(message: str, default: str) -> str | None:
    """The request field an engine ``ValueError`` is about (``default``: the prompt)."""
    word = message.split(" ", 1)[0]
    if word in ("logit_bias", "allowed_token_ids"):
        return word
    return default


Prefilled = Callable[[RequestOutput], Awaitable[None]]
"""Called once per engine request when its prompt is in the cache (its first token, or its end):
the Messages API retains its ``cache_control`` breakpoints there. It must not raise."""


@dataclass(slots=True)
class _Job:
    """The engine requests of one HTTP request and how far each has got."""

    stream: AsyncIterator[RequestOutput]
    request_id: str
    first: RequestOutput
    last: RequestOutput
    done: bool = False
    ttft: float | None = None
    on_prefilled: Prefilled | None = None
    trace: RequestTrace | None = None  # its span, with --otlp-traces-endpoint


async def _prefilled(job: _Job, out: RequestOutput) -> None:
    """Run the job's :data:`Prefilled` hook once its prompt is computed (a token, or the end)."""
    hook = job.on_prefilled
    if hook is not None and (out.finished or any(o.token_ids for o in out.outputs)):
        job.on_prefilled = None
        await hook(out)


class OpenAIServing:
    """Runs completions and chat requests against an engine and records their metrics.

    ``engine`` is the shared ``AsyncEngine`` (not owned); with ``tracer`` every engine
    request's span is exported when it ends.
    """

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits | None = None, tracer: RequestTracer | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits if limits is not None else ServerLimits()
        self.tracer = tracer
        self._pool_tokens: int | None = None

    def served_name(self, model: str | None) -> str:
        """The ``model`` an answer reports: the LoRA adapter the request named (vLLM's), else
        the base model's name."""
        return adapter_of(self.engine, model) or self.model_name

    def check_limits(self, req: SamplingRequest, num_prompts: int) -> None:
        problems = req.problems()
        if problems:
            raise APIError(problems[0][1], param=problems[0][0])
        lim = self.limits
        if req.n > lim.max_n:
            raise APIError(f"n must be at most {lim.max_n} (--max-n), got {req.n}", param="n")
        if num_prompts > lim.max_prompts:
            raise APIError(f"a request may hold at most {lim.max_prompts} prompts "
                           f"(--max-prompts-per-request), got {num_prompts}", param="prompt")

    async def completions(self, req: CompletionRequest,
                          is_disconnected: Disconnected) -> JSONResponse | StreamingResponse:
        """``POST /v1/completions``."""
        prompts = [req.prompt_options(p, self.engine.max_model_len, req.add_special_tokens)
                   for p in req.prompts()]
        self.check_limits(req, len(prompts))
        structured, _ = await output_constraint(self.engine, req)
        echo_only = req.max_tokens == 0  # echo the prompt (and its logprobs) only
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, req.logprobs)
        params = sampling_params(
            req, 1 if echo_only else (req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS),
            logprobs=req.logprobs, prompt_logprobs=prompt_lp, structured=structured,
            retention=retention_of(req, self.limits.max_retention_priority))
        view = self._renderer(req, chat=False, num_logprobs=req.logprobs, echo=req.echo,
                              echo_only=echo_only)
        return await self._run("cmpl", prompts, params, req, is_disconnected, view)

    def _renderer(self, req: SamplingRequest, **kwargs: Any) -> ChoiceRenderer:
        tok = self.engine.tokenizer
        if req.logprob_token_ids and kwargs["num_logprobs"] is not None:  # vLLM: every candidate
            kwargs["num_logprobs"] = 1 << 20
        return ChoiceRenderer(
            decode=lambda t: tok.decode([t], skip_special_tokens=False),
            decode_ids=lambda ids: tok.decode(ids, skip_special_tokens=False),
            token_ids=req.return_token_ids, as_ids=bool(req.return_tokens_as_token_ids),
            prompt_logprobs=req.prompt_logprobs is not None, **kwargs)

    async def chat(self, req: ChatCompletionRequest, is_disconnected: Disconnected,
                   on_prefilled: Prefilled | None = None) -> JSONResponse | StreamingResponse:
        """``POST /v1/chat/completions`` (``on_prefilled``: see :data:`Prefilled`)."""
        check_prompt_chars(self.engine.max_model_len, {"messages": req.messages, "tools": req.tools})
        self.check_limits(req, 1)
        structured, tool_mode = await output_constraint(self.engine, req)
        prompt = req.prompt_options(await self.chat_prompt(req), self.engine.max_model_len)
        keep = prompt.get("truncate_prompt_tokens")
        max_tokens = req.effective_max_tokens
        if max_tokens is None:
            num = len(prompt["prompt_token_ids"])
            room = await self.room_left(num if keep is None else min(num, keep))
            max_tokens = None if room is None else min(room, self.limits.default_chat_max_tokens)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens, logprobs=num_logprobs,
                                 prompt_logprobs=req.prompt_logprobs, structured=structured,
                                 retention=retention_of(req, self.limits.max_retention_priority))
        view = self._renderer(req, chat=True, num_logprobs=num_logprobs, tool_mode=tool_mode)
        return await self._run("chatcmpl", [prompt], params, req, is_disconnected, view,
                               on_prefilled)

    async def chat_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """A chat body's messages through the chat template (with its ``chat_template_kwargs``
        and tools): ``{"prompt", "prompt_token_ids"}``; 400s name the field. (The engine
        truncates later, by the request's ``truncate_prompt_tokens``.)"""
        try:
            options = template_options(req.chat_template_kwargs, req.add_generation_prompt,
                                       req.continue_final_message)
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(".")[0].split()[0]) from exc
        if req.tools:
            options.setdefault("tools", [t.model_dump(exclude_none=True) for t in req.tools])
        try:
            return await self.engine.chat_prompt_async(req.plain_messages(), **options)
        except ValueError as exc:
            raise APIError(f"cannot render messages: {exc}", param="messages") from exc

    async def room_left(self, prompt_tokens: int) -> int | None:
        """Chat's default ``max_tokens`` (vLLM's): the room the prompt leaves in the context,
        capped so the request fits the KV pool; ``None`` (the engine then explains) if none."""
        if self._pool_tokens is None:
            stats = await self.engine.get_stats()
            self._pool_tokens = stats.num_kv_blocks * stats.block_size
        room = min(self.engine.max_model_len, self._pool_tokens) - prompt_tokens
        return room if room >= 1 else None

    async def _run(self, kind: str, prompts: list[Any], params: SamplingParams,
                   req: SamplingRequest, is_disconnected: Disconnected,
                   view: ChoiceRenderer, on_prefilled: Prefilled | None = None
                   ) -> JSONResponse | StreamingResponse:
        """Submit, then answer whole or streamed. The response id is ``<kind>-<request_id>``
        (the body's ``request_id`` or the ``X-Request-Id`` header, as vLLM's) or a random one;
        engine ids add a random suffix to a client's id (two clients may send the same)."""
        t0 = time.perf_counter()
        chat = view.chat
        rid = f"{kind}-{req.request_id or uuid.uuid4().hex}"
        engine_rid = f"{rid}-{uuid.uuid4().hex[:8]}" if req.request_id else rid
        lora = adapter_of(self.engine, req.model)
        model = lora or self.model_name
        jobs = await self._submit(engine_rid, prompts, params, req, lora, chat=chat, t0=t0,
                                  on_prefilled=on_prefilled)
        if req.stream:
            opts = req.stream_options
            return EngineStreamingResponse(
                self._stream(rid, model, jobs, params.n, view, t0=t0,
                             include_usage=bool(opts and opts.include_usage),
                             continuous_usage=bool(opts and opts.continuous_usage_stats)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        async def drain() -> None:
            for job in jobs:
                while not job.done:
                    await self._advance(job, t0)

        try:
            await finish_unless_gone(asyncio.ensure_future(drain()), is_disconnected)
        finally:
            await self._abort_unfinished(jobs, t0)
        return JSONResponse(self._final_body(rid, model, jobs, params.n, view))

    async def _submit(self, rid: str, prompts: list[Any], params: SamplingParams,
                      req: SamplingRequest, lora: str | None, *, chat: bool, t0: float,
                      on_prefilled: Prefilled | None = None) -> list[_Job]:
        """Start one engine request per prompt and wait for each one's first output, so a
        submission error becomes a 400 before the response starts. On any failure every
        request already started is aborted."""
        param = "messages" if chat else "prompt"

        async def start(i: int, prompt: Any) -> _Job:
            sub_id = rid if len(prompts) == 1 else f"{rid}-{i}"
            stream = self.engine.generate(prompt, params, request_id=sub_id,
                                          cache_salt=req.cache_namespace,
                                          lora_request=lora)
            try:
                first = await stream.__anext__()
            except ValueError as exc:
                raise APIError(str(exc), param=_param_of(str(exc), param)) from exc
            except RuntimeError as exc:
                raise engine_failure(exc) from exc
            except StopAsyncIteration as exc:
                raise APIError("the engine returned no output", status=500) from exc
            trace = None if self.tracer is None else self.tracer.begin(
                sub_id, params, model=lora or self.model_name, cache_salt=req.cache_namespace,
                lora=lora, started=t0, reports_tokens=req.max_tokens != 0)  # 0: echo only
            job = _Job(stream=stream, request_id=sub_id, first=first, last=first,
                       on_prefilled=on_prefilled, trace=trace)
            await _prefilled(job, first)
            return job

        results = await asyncio.gather(*(start(i, p) for i, p in enumerate(prompts)),
                                       return_exceptions=True)
        jobs = [r for r in results if isinstance(r, _Job)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            await self._abort_unfinished(jobs)
            raise failure
        for job in jobs:
            self._observe(job, job.first, t0, first_report=True)
        return jobs

    async def _advance(self, job: _Job, t0: float) -> RequestOutput:
        """Wait for the job's next output (the caller checks ``job.done`` first)."""
        try:
            out = await job.stream.__anext__()
        except StopAsyncIteration:
            job.done = True
            return job.last
        except Exception:  # the request failed (its stream is over): not an abort
            job.done = True
            raise
        self._observe(job, out, t0, first_report=False)
        await _prefilled(job, out)
        return out

    def _observe(self, job: _Job, out: RequestOutput, t0: float, *, first_report: bool) -> None:
        now = time.perf_counter()
        if first_report:
            self.metrics.observe_prompt(len(out.prompt_token_ids), out.num_cached_tokens,
                                        out.num_external_cached_tokens, out.num_external_queried_tokens)
        job.last = out
        if job.ttft is None and any(o.token_ids for o in out.outputs):
            job.ttft = now - t0
        if out.finished and not job.done:
            job.done = True
            self.metrics.observe_output(out, [o.finish_reason or "unknown" for o in out.outputs],
                              job.ttft, now - t0)
            if job.trace is not None:
                job.trace.end(out, job.ttft, now - t0)

    async def _abort_unfinished(self, jobs: list[_Job], t0: float | None = None) -> None:
        """Abort every engine request of ``jobs`` that has not finished (frees its blocks):
        closing an unfinished ``AsyncEngine.generate`` stream aborts its request. With ``t0``
        (the response had started) each one counts as finished with reason ``"abort"``."""
        for job in jobs:
            if not job.done:
                job.done = True
                await job.stream.aclose()  # type: ignore[attr-defined]
                if t0 is not None:
                    self.metrics.observe_output(job.last, ["abort"] * len(job.last.outputs), job.ttft,
                                      time.perf_counter() - t0)
                    if job.trace is not None:
                        job.trace.end(job.last, job.ttft, time.perf_counter() - t0)

    # ------------------------------------------------------------------ bodies

    def _usage(self, jobs: list[_Job], view: ChoiceRenderer) -> dict[str, Any]:
        prompt = sum(len(j.last.prompt_token_ids) for j in jobs)
        completion = sum(view.num_generated(o) for j in jobs for o in j.last.outputs)
        cached = sum(j.last.num_cached_tokens for j in jobs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _final_body(self, rid: str, model: str, jobs: list[_Job], n: int, view: ChoiceRenderer
                    ) -> dict[str, Any]:
        choices = [view.final(p * n + o.index, job.last, o)
                   for p, job in enumerate(jobs) for o in job.last.outputs]
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if view.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": self._usage(jobs, view),
        }
        if view.chat and view.token_ids:  # vLLM's return_token_ids: the prompt's at the top
            body["prompt_token_ids"] = list(jobs[0].last.prompt_token_ids)
        return body

    async def _stream(self, rid: str, model: str, jobs: list[_Job], n: int, view: ChoiceRenderer, *,
                      include_usage: bool, continuous_usage: bool, t0: float
                      ) -> AsyncIterator[bytes]:
        """SSE chunks: per-choice deltas (with ``continuous_usage`` each carries the usage so
        far), then (``include_usage``) a usage chunk, then ``[DONE]``. Closing this generator
        early aborts the unfinished engine requests."""
        created = int(time.time())
        obj = "chat.completion.chunk" if view.chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  **extra: Any) -> bytes:
            body: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                    "model": model, "choices": choices, **extra}
            if include_usage or continuous_usage:
                body["usage"] = self._usage(jobs, view) if continuous_usage and usage is None else usage
            return sse(body)

        def deltas(p: int, out: RequestOutput, job: _Job) -> list[dict[str, Any]]:
            """Choices for what each sample added since the last chunk sent."""
            pieces = (view.delta(p * n + o.index, out, o) for o in out.outputs)
            return [piece for piece in pieces if piece is not None]

        pending: dict[asyncio.Future[RequestOutput], tuple[int, _Job]] = {}
        try:
            for p, job in enumerate(jobs):
                first = deltas(p, job.first, job)
                if first and view.chat and view.token_ids:  # the prompt's ids on the first chunk
                    yield chunk(first, prompt_token_ids=list(job.first.prompt_token_ids))
                elif first:
                    yield chunk(first)
            pending = {asyncio.ensure_future(self._advance(job, t0)): (p, job)
                       for p, job in enumerate(jobs) if not job.done}
            while pending:
                finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    p, job = pending.pop(task)
                    choices = deltas(p, task.result(), job)
                    if choices:
                        yield chunk(choices)
                    if not job.done:
                        pending[asyncio.ensure_future(self._advance(job, t0))] = (p, job)
            if include_usage:
                yield chunk([], self._usage(jobs, view))
            yield sse("[DONE]")
        except (ValueError, RuntimeError) as exc:  # the engine failed after the stream started
            err = engine_failure(exc)
            self.metrics.observe_error(err.status)
            yield sse(err.body())
            yield sse("[DONE]")
        finally:
            # Runs on normal end, on client disconnect (cancellation) and on aclose().
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            await self._abort_unfinished(jobs, t0)
