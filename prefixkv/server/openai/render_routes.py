"""Owns: vLLM's render API (the token ids and sampling a request would run).
Imports: the server core and this package's protocol, request_params, serving and tools.

vLLM's render API: ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``.

What a request would run, without running it: the prompt after the chat template, as the token
ids the engine would prefill, and the sampling settings, in vLLM's token-in ``GenerateRequest``
shape (the body of vLLM's ``/inference/v1/generate``)::

    POST /v1/chat/completions/render  (a chat body)
      -> {"request_id": "chatcmpl-...", "token_ids": [...], "features": null,
          "sampling_params": {...}, "model": ..., "stream": false, "stream_options": null,
          "cache_salt": ..., "priority": ..., "kv_transfer_params": null}
    POST /v1/completions/render  (a completions body)
      -> [one such object per prompt ("cmpl-..." ids)]

Routers and schedulers call it to tokenize exactly as the worker does (vllm-router posts it to
each worker; llm-d's token producer uses it for its KV-block keys). Validation is the real
route's: a body that ``/v1/chat/completions`` would refuse is the same 400 here. Owns no state;
imports the server's request models and sampling-parameter mapping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import APIRouter

from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.server.fields import FieldPolicy
from prefixkv.server.limits import check_prompt_chars
from prefixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from prefixkv.server.openai.request_params import sampling_params
from prefixkv.server.openai.serving import COMPLETIONS_DEFAULT_MAX_TOKENS, OpenAIServing
from prefixkv.server.openai.tools import output_constraint

__all__ = ["build_render_router", "plain_sampling_params"]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.name.startswith("_")}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def plain_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """``params`` as JSON under vLLM's field names (stop strings as a list, structured outputs
    as an object)."""
    out: dict[str, Any] = _plain(params)
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def _truncate(ids: list[int], req: SamplingRequest, max_model_len: int) -> list[int]:
    keep = max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if req.truncation_side == "right" else ids[len(ids) - keep:]


def _generate_request(kind: str, req: SamplingRequest, ids: list[int],
                      params: SamplingParams) -> dict[str, Any]:
    return {
        "request_id": f"{kind}-{req.request_id or uuid.uuid4().hex}",
        "token_ids": ids, "features": None, "sampling_params": plain_sampling_params(params),
        "model": req.model, "stream": bool(req.stream),
        "stream_options": (req.stream_options.model_dump(exclude_none=True)
                           if req.stream and req.stream_options else None),
        "cache_salt": req.cache_salt, "priority": req.priority or 0, "kv_transfer_params": None,
    }


def build_render_router(serving: OpenAIServing, policy: FieldPolicy,
                        check_model: Callable[[str | None], None]) -> APIRouter:
    """The two render routes over ``serving``'s engine (mounted under ``/v1``)."""
    router = APIRouter()
    engine = serving.engine

    @router.post("/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        policy.check(body)
        check_model(body.model)
        check_prompt_chars(engine.max_model_len, {"messages": body.messages, "tools": body.tools})
        serving.check_limits(body, 1)
        structured, _ = await output_constraint(engine, body)
        prompt = await serving.chat_prompt(body)
        ids = _truncate(list(prompt["prompt_token_ids"]), body, engine.max_model_len)
        max_tokens = body.effective_max_tokens
        if max_tokens is None:  # the chat route's default: the room the prompt leaves
            room = await serving.room_left(len(ids))
            max_tokens = None if room is None else min(room, serving.limits.default_chat_max_tokens)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, logprobs=num_logprobs,
                                 prompt_logprobs=body.prompt_logprobs, structured=structured)
        return _generate_request("chatcmpl", body, ids, params)

    @router.post("/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        policy.check(body)
        check_model(body.model)
        prompts = body.prompts()
        serving.check_limits(body, len(prompts))
        structured, _ = await output_constraint(engine, body)
        params = sampling_params(body, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
                                 logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs,
                                 structured=structured)
        special = body.add_special_tokens
        for prompt in prompts:  # the length guard, before any tokenizing
            check_prompt_chars(engine.max_model_len, {"prompt": prompt})
        out = []
        for prompt in prompts:
            ids = (list(prompt) if not isinstance(prompt, str) else await asyncio.to_thread(
                engine.tokenizer.encode, prompt, add_special_tokens=special))
            out.append(_generate_request("cmpl", body, _truncate(ids, body, engine.max_model_len),
                                         params))
        return out

    return router
