"""Owns: SGLang's native routes (``/generate``, ``/flush_cache``, ``/model_info``, ...).
Imports: prefixkv.engine, prefixkv.wire, the server core, logprobs.py, server.openai.tools.

SGLang's native routes on the same engine: ``POST /generate``, ``/flush_cache``, ``/model_info``.

Clients written for SGLang's own API (``sglang.bench_serving --backend sglang``, scripts that
read ``meta_info.cached_tokens``, health checks that flush the radix cache between runs) work
unchanged. ``/generate`` takes ``text`` or ``input_ids`` (one prompt or a batch) and SGLang's
``sampling_params`` (``max_new_tokens`` 128 by default, ``min_new_tokens``, ``stop``,
``stop_token_ids``, ``stop_regex``, ``json_schema`` / ``regex`` / ``ebnf``, ``no_stop_trim``,
``sampling_seed``, ...;
``max_new_tokens`` 0 prefills the prompt into the cache and generates nothing), and answers
``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "e2e_latency"}}`` (a list for a batch or ``n > 1``), with
``return_logprob`` SGLang's logprob lists too (:mod:`prefixkv.server.sglang.logprobs`); with
``stream`` each event carries the text and ids so far, as SGLang's default streaming does, then
``data: [DONE]``. SGLang's frontend language (``sglang.RuntimeEndpoint``: ``gen``, ``select``,
regex and typed ``gen``, streaming) runs on it unchanged. Fields we do not implement (images)
are a 400 naming them; unknown ones follow the server's field policy.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool, field_validator, model_validator

from prefixkv import __version__
from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.engine.outputs import CompletionOutput, RequestOutput
from prefixkv.engine.sampling_params import SamplingParams, check_logit_bias_size
from prefixkv.engine.structured_output import StructuredOutputsParams
from prefixkv.wire.kv_events import request_salt
from prefixkv.server.errors import APIError
from prefixkv.server.fields import FieldPolicy
from prefixkv.server.json_body import FastJSONRoute
from prefixkv.server.limits import ServerLimits
from prefixkv.server.retention import request_retention
from prefixkv.server.metrics import ServerMetrics
from prefixkv.server.bodies import TokenId, _Body
from prefixkv.server.lora_routes import adapter_names, adapter_of
from prefixkv.server.streaming import EngineStreamingResponse, engine_failure, finish_unless_gone, sse
from prefixkv.server.sglang.logprobs import LogprobFormatter, LogprobOptions
from prefixkv.server.openai.tools import compile_constraint
from prefixkv.server.tracing import RequestTrace, RequestTracer

HEALTH_TIMEOUT_S = 20.0
"""How long ``/health_generate`` waits for its token (SGLang's ``HEALTH_CHECK_TIMEOUT``)."""

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")
"""SGLang's answer text (clients match on it); here running requests keep their blocks."""


class SGLangSampling(_Body):
    """SGLang's ``sampling_params`` (its names; ``top_k`` -1 or a huge value: disabled)."""

    max_new_tokens: Annotated[int, Field(strict=True, ge=0)] | None = 128
    min_new_tokens: Annotated[int, Field(strict=True, ge=0)] = 0
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    n: Annotated[int, Field(strict=True, ge=1)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    """Accepted, with no effect: fast tokenizers join special tokens without spaces either way
    (vLLM applies the flag to slow tokenizers only)."""
    no_stop_trim: StrictBool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_size_first(cls, value: Any) -> Any:
        """The size bound before pydantic checks each entry (see the OpenAI request's)."""
        if isinstance(value, dict):
            check_logit_bias_size(value)
        return value

    def to_params(self, **extra: Any) -> SamplingParams:
        """Our :class:`SamplingParams`, with ``extra`` fields (``ValueError`` naming the bad
        field). ``max_new_tokens`` 0 runs one step (the prefill); the route drops its token."""
        given: dict[str, Any] = {k: v for k, v in (("json", self.json_schema), ("regex", self.regex),
                                   ("grammar", self.ebnf)) if v is not None}
        if len(given) > 1:  # SGLang's rule too
            raise ValueError("give only one of sampling_params.json_schema, regex and ebnf")
        structured = StructuredOutputsParams(**given) if given else None
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p,
            top_k=-1 if self.top_k == -1 or self.top_k >= 1 << 30 else self.top_k, min_p=self.min_p,
            seed=self.sampling_seed, max_tokens=self.max_new_tokens or (None if self.max_new_tokens is None else 1),
            stop=stops or None, stop_regex=self.stop_regex or None,  # (the frontend sends [])
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            min_tokens=0 if self.max_new_tokens == 0 else min(self.min_new_tokens, self.max_new_tokens or self.min_new_tokens),
            include_stop_str_in_output=self.no_stop_trim, structured_outputs=structured,
            logit_bias=None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()},
            **extra)


class GenerateRequest(LogprobOptions):
    """``POST /generate``: exactly one of ``text`` and ``input_ids``."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLangSampling = Field(default_factory=SGLangSampling)
    stream: StrictBool = False
    rid: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    extra_key: Annotated[str, Field(min_length=1)] | None = None
    lora_path: str | list[str | None] | None = None  # SGLang's: a loaded adapter's name, per prompt
    priority: Annotated[int, Field(strict=True)] | None = None
    """SGLang's: above 0, the retention priority of what the request caches (capped by
    ``--max-retention-priority``; ``server/retention.py``)."""

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self

    def prompts(self) -> tuple[list[Any], bool]:
        """The prompts and whether the request was a batch."""
        if isinstance(self.text, str):
            return [self.text], False
        if self.text is not None:
            return list(self.text), True
        ids = self.input_ids or []
        if ids and isinstance(ids[0], list):
            return list(ids), True
        return [ids], False


def _adapters(engine: AsyncEngine, lora_path: str | list[str | None] | None,
              n: int) -> list[str | None]:
    """Each prompt's adapter from SGLang's ``lora_path`` (one name for all, or one per prompt;
    ``None``: the base model); a 400 naming ``lora_path`` for an unknown name or a wrong count."""
    names = lora_path if isinstance(lora_path, list) else [lora_path] * n
    if len(names) != n:
        raise APIError(f"lora_path has {len(names)} entries for {n} prompts", param="lora_path")
    for name in names:
        if name is not None and adapter_of(engine, name) is None:
            raise APIError(f"lora_path names {name!r}, not a loaded adapter (known: "
                           f"{adapter_names(engine)}; serve with --enable-lora --lora-modules)",
                           param="lora_path")
    return names


def _finish(o: CompletionOutput) -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` object (``None`` while running)."""
    if o.finish_reason is None:
        return None
    if o.finish_reason == "length":
        return {"type": "length", "length": len(o.token_ids)}
    if o.finish_reason == "stop":
        return {"type": "stop", "matched": o.stop_reason if o.stop_reason is not None else
                (o.token_ids[-1] if o.token_ids else None)}
    return {"type": "abort", "message": o.finish_reason}


@dataclass(slots=True)
class _Shape:
    """How one request's results are written: from its start time ``t0``; ``prefill_only``
    (``max_new_tokens`` 0: the engine's one step shows no token); its logprob lists, if asked."""

    t0: float
    prefill_only: bool
    logprobs: LogprobFormatter | None

    def item(self, out: RequestOutput, o: CompletionOutput) -> dict[str, Any]:
        """One result: ``{"text", "output_ids", "meta_info"}``."""
        ids = [] if self.prefill_only else list(o.token_ids)
        finish = _finish(o)
        if self.prefill_only and finish is not None:
            finish = {"type": "length", "length": 0}
        meta = {"id": out.request_id if len(out.outputs) == 1 else f"{out.request_id}-{o.index}",
                "finish_reason": finish, "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(ids), "cached_tokens": out.num_cached_tokens,
                "e2e_latency": time.perf_counter() - self.t0}
        if self.logprobs is not None:
            meta.update(self.logprobs.meta(out, o, len(ids)))
        return {"text": "" if self.prefill_only else o.text, "output_ids": ids, "meta_info": meta}


def build_sglang_router(engine: AsyncEngine, policy: FieldPolicy, model_name: str,
                        limits: ServerLimits, metrics: ServerMetrics,
                        tracer: RequestTracer | None = None) -> tuple[APIRouter, Any]:
    """The inference routes above for ``engine`` (held to the OpenAI routes' ``limits`` on
    ``n`` and prompts per request, counted in the same ``metrics``, each request's span sent
    with ``tracer``), and the ``/flush_cache`` handler (an admin route, mounted by the app
    with the other admin routes)."""

    def observe(outs: list[RequestOutput], t0: float) -> None:
        for out in outs:  # each finished request: its tokens, finish reasons and phases
            metrics.observe_output(out, [o.finish_reason or "" for o in out.outputs], None,
                                   time.perf_counter() - t0)

    router = APIRouter(route_class=FastJSONRoute)  # bodies decoded by msgspec (json_body.py)

    @router.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        policy.check(body)
        prompts, batch = body.prompts()
        if body.sampling_params.n > limits.max_n:
            raise APIError(f"n must be at most {limits.max_n} (--max-n), got {body.sampling_params.n}",
                           param="sampling_params.n")
        if len(prompts) > limits.max_prompts:
            raise APIError(f"a request may hold at most {limits.max_prompts} prompts "
                           f"(--max-prompts-per-request), got {len(prompts)}",
                           param="text" if body.text is not None else "input_ids")
        try:
            params = body.sampling_params.to_params(**body.engine_fields(), retention=request_retention(
                priority=body.priority, ttl_s=None, cap=limits.max_retention_priority))
        except ValueError as exc:
            about_ids = str(exc).startswith("logprob_token_ids")
            raise APIError(str(exc), param="token_ids_logprob" if about_ids else "sampling_params") from exc
        if params.structured_outputs is not None:  # compiled now: guarded, off the engine thread
            sp = body.sampling_params
            given = "json_schema" if sp.json_schema is not None else "regex" if sp.regex is not None else "ebnf"
            await compile_constraint(engine, params.structured_outputs, f"sampling_params.{given}")
        base = body.rid or uuid.uuid4().hex
        shape = _Shape(time.perf_counter(), body.sampling_params.max_new_tokens == 0, None if not
                       body.return_logprob else LogprobFormatter(body, lambda t: str(
                           engine.tokenizer.decode([t], skip_special_tokens=False))))
        loras = _adapters(engine, body.lora_path, len(prompts))
        rids = [f"{base}-{uuid.uuid4().hex[:8]}" for _ in prompts]
        salt = request_salt(body.cache_salt, body.extra_key)
        streams = [engine.generate(p, params, request_id=rid, cache_salt=salt, lora_request=lora)
                   for p, lora, rid in zip(prompts, loras, rids)]
        traces: dict[str, RequestTrace] = {} if tracer is None else {
            rid: tracer.begin(rid, params, model=lora or model_name, cache_salt=salt, lora=lora,
                              started=shape.t0, reports_tokens=not shape.prefill_only)
            for rid, lora in zip(rids, loras)}

        def finished(outs: list[RequestOutput], t0: float) -> None:
            observe(outs, t0)
            for out in outs:
                trace = traces.pop(out.request_id, None)
                if trace is not None:
                    trace.end(out, None, time.perf_counter() - t0)
        try:  # the first output of each: a bad prompt is a 400 before anything is sent
            firsts = [await s.__anext__() for s in streams]
        except ValueError as exc:  # a bad prompt, or a grammar that does not compile
            await _close(streams)
            param = ("sampling_params" if str(exc).startswith("structured_outputs:") else
                     "token_ids_logprob" if str(exc).startswith("logprob_token_ids") else
                     "text" if body.text is not None else "input_ids")
            raise APIError(str(exc), param=param) from exc
        except RuntimeError as exc:
            await _close(streams)
            raise engine_failure(exc) from exc
        try:
            for out in firsts:
                body.check_prompt(len(out.prompt_token_ids))
        except ValueError as exc:
            await _close(streams)
            raise APIError(str(exc), param="logprob_start_len") from exc
        for out in firsts:
            metrics.observe_prompt(len(out.prompt_token_ids), out.num_cached_tokens,
                                   out.num_external_cached_tokens, out.num_external_queried_tokens)
        many = batch or params.n > 1
        if body.stream:
            return EngineStreamingResponse(_events(streams, firsts, shape, many, finished),
                                           media_type="text/event-stream")
        lasts = await _drain(streams, firsts, request)
        finished(lasts, shape.t0)
        items = [shape.item(out, o) for out in lasts for o in out.outputs]
        return JSONResponse(items if many else items[0])

    async def flush_cache() -> Response:
        await engine.reset_prefix_cache()
        return Response(FLUSHED, media_type="text/plain")

    @router.get("/health_generate", response_class=Response, responses={
        200: {"description": "the engine generated a token (empty body)", "content": {}},
        503: {"description": "the engine failed or was too slow (empty body)", "content": {}}})
    async def health_generate() -> Response:
        """SGLang's deep health check: 200 once a one-token generation gives its first output
        (a busy engine answers within a step), 503 when the engine fails or takes longer than
        :data:`HEALTH_TIMEOUT_S`. Not counted in the request metrics (as SGLang's)."""
        stream = engine.generate([0], SamplingParams(max_tokens=1, temperature=0.0),
                                 request_id=f"health-{uuid.uuid4().hex}")
        try:
            await asyncio.wait_for(stream.__anext__(), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, ValueError, RuntimeError, StopAsyncIteration):
            return Response(status_code=503)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return Response(status_code=200)

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        stats = await engine.get_stats()
        return {"model_path": model_name, "served_model_name": model_name,
                "context_length": engine.max_model_len, "page_size": stats.block_size,
                "max_total_num_tokens": stats.num_kv_blocks * stats.block_size,
                "disable_radix_cache": not stats.enable_prefix_caching, "dp_size": 1, "tp_size": 1,
                "version": f"prefixkv {__version__}",
                "internal_states": [{"num_running": stats.num_running, "num_waiting": stats.num_waiting}]}

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": model_name, "served_model_name": model_name, "tokenizer_path": model_name,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False}

    return router, flush_cache


async def _events(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput],
                  shape: _Shape, many: bool, observe: Any) -> AsyncIterator[bytes]:
    """SSE events: each prompt's outputs in turn, text and ids so far, then ``[DONE]``;
    closing it (the client left) closes the engine streams, aborting their requests."""
    try:
        for s, out in zip(streams, firsts):
            while True:
                items = [shape.item(out, o) for o in out.outputs]
                yield sse(items if many else items[0])
                try:
                    out = await s.__anext__()
                except StopAsyncIteration:
                    break
            observe([out], shape.t0)
        yield sse("[DONE]")
    except (ValueError, RuntimeError) as exc:  # the engine failed after the stream started
        yield sse(engine_failure(exc).body())
    finally:
        await _close(streams)


async def _drain(streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput],
                 request: Request) -> list[RequestOutput]:
    """Each stream's last output; a client that goes away (noticed between polls) has its
    requests aborted, as on the OpenAI routes."""
    async def last(s: AsyncIterator[RequestOutput], out: RequestOutput) -> RequestOutput:
        async for out in s:  # noqa: B007 (the last one is the answer)
            pass
        return out

    task = asyncio.ensure_future(asyncio.gather(*(last(s, f) for s, f in zip(streams, firsts))))
    try:
        done: list[RequestOutput] = await finish_unless_gone(task, request.is_disconnected)
        return done
    finally:
        await _close(streams)


async def _close(streams: list[AsyncIterator[RequestOutput]]) -> None:
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]
