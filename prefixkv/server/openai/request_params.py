"""Owns: a request body's sampling settings as the engine's ``SamplingParams``.
Imports: prefixkv.engine, errors.py, protocol.py.

A request body's sampling settings as the engine's :class:`SamplingParams` (vLLM's mapping).

Shared by the OpenAI routes (completions, chat, and through chat the Responses and Messages
APIs) and vLLM's render API; an invalid combination the engine refuses is a 400.
"""

from __future__ import annotations

from prefixkv.cache.retention import Retention
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.structured_output import StructuredOutputsParams
from prefixkv.server.errors import APIError
from prefixkv.server.openai.protocol import SamplingRequest
from prefixkv.server.retention import PROMPT_CACHE_RETENTION, request_retention

__all__ = ["retention_of", "sampling_params"]


def retention_of(req: SamplingRequest, max_priority: int) -> Retention | None:
    """What a body's ``prompt_cache_retention`` and ``priority`` ask the cache to keep
    (``max_priority``: ``--max-retention-priority``)."""
    ttl = None if req.prompt_cache_retention is None else PROMPT_CACHE_RETENTION[req.prompt_cache_retention]
    return request_retention(priority=req.priority, ttl_s=ttl, cap=max_priority)


def sampling_params(req: SamplingRequest, max_tokens: int | None, *, logprobs: int | None = None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None,
                    retention: Retention | None = None) -> SamplingParams:
    """The engine's sampling params for a validated request body (``retention``:
    :func:`retention_of`'s)."""
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=req.stop_list or None, stop_regex=req.stop_regex,
            stop_token_ids=req.stop_token_ids,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.bias,
            allowed_token_ids=req.allowed_token_ids,
            min_tokens=req.min_tokens if max_tokens is None else min(req.min_tokens, max_tokens),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output or req.no_stop_trim,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=0 if req.logprob_token_ids and logprobs is not None else logprobs,  # (vLLM's rule)
            logprob_token_ids=req.logprob_token_ids, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured, retention=retention, cache_key=req.prompt_cache_key,
        )
    except ValueError as exc:
        raise APIError(str(exc)) from exc
