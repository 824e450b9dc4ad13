"""Owns: vLLM's ``/tokenize``, ``/detokenize``, ``/tokenizer_info``, ``/version``.
Imports: prefixkv.engine and the server core only.

vLLM's tokenizer and info routes: ``/tokenize``, ``/detokenize``, ``/tokenizer_info``, ``/version``.

Shapes as vLLM's (lm-eval's ``local-completions`` with a remote tokenizer uses them)::

    POST /tokenize    {"prompt": str, "add_special_tokens": true}  or  {"messages": [...]}
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info -> {"tokenizer_class", "eos_token", "bos_token", "chat_template", ...}
    GET  /version     -> {"version": str}
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import Field, StrictBool, model_validator

from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.engine.prompts import template_options
from prefixkv.server.errors import APIError
from prefixkv.server.fields import FieldPolicy
from prefixkv.server.limits import MAX_MESSAGES, check_prompt_chars
from prefixkv.server.bodies import ChatMessage, TokenId, _Body


class TokenizeRequest(_Body):
    """``POST /tokenize``: a completion ``prompt`` or chat ``messages`` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


def package_version() -> str:
    """prefixkv's installed version (``"0+unknown"`` when run from a plain checkout)."""
    try:
        return version("prefixkv")
    except PackageNotFoundError:
        return "0+unknown"


def build_tokenizer_router(engine: AsyncEngine, check_model: Callable[[str | None], None],
                           policy: FieldPolicy) -> APIRouter:
    """The routes above for ``engine``; ``check_model`` 404s an unknown ``model``."""
    router = APIRouter()
    tok = engine.tokenizer
    vocab = engine.engine.runner.config.vocab_size

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_prompt_chars(engine.max_model_len, {"prompt": body.prompt, "messages": body.messages})
        policy.check(body)
        check_model(body.model)
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                options = template_options(body.chat_template_kwargs, body.add_generation_prompt,
                                           body.continue_final_message)
            except ValueError as exc:
                raise APIError(str(exc), param=str(exc).split(".")[0].split()[0]) from exc
            try:
                rendered = await engine.chat_prompt_async(messages, **options)
            except ValueError as exc:
                raise APIError(f"cannot render messages: {exc}", param="messages") from exc
            ids = list(rendered["prompt_token_ids"])
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(tok.encode, body.prompt or "", add_special_tokens=special)
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        policy.check(body)
        check_model(body.model)
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(f"tokens has ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                           param="tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token": None,
            "chat_template": tok.chat_template,
            "model_max_length": engine.max_model_len,
            "vocab_size": tok.vocab_size,
            "add_bos_token": tok.bos_token_id is not None,
        }

    @router.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": package_version()}

    return router
