"""Owns: LoRA adapters as model names (every dialect resolves them) and vLLM's load / unload routes.
Imports: prefixkv.engine, bodies.py, errors.py; no dialect.

LoRA adapters on the server: a request names one as its ``model``; vLLM's runtime routes.

With ``--enable-lora`` every known adapter is a model name: ``/v1/models`` lists it with
``parent`` (and ``root``) the base model, and a completions, chat, Responses or Messages request
whose ``model`` is its name runs on it (:func:`adapter_of`). vLLM's admin routes add and drop
adapters while the server runs (mounted behind the admin rule, as vLLM keeps them behind
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)::

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Loading reads the adapter on the engine thread between steps (requests keep stepping around
it; a bad adapter is a 400 naming ``lora_path``). Loading a known name again replaces its
weights: later requests read none of the old adapter's cached blocks (the engine keys them by
the weights' digest). Owns no state: the registry is the engine's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import Field

from prefixkv.engine.async_engine import AsyncEngine
from prefixkv.server.errors import APIError
from prefixkv.server.bodies import _Body

__all__ = ["adapter_names", "adapter_of", "build_lora_router"]


def adapter_names(engine: AsyncEngine) -> list[str]:
    """The adapters a request may name (empty without ``--enable-lora``)."""
    registry = engine.engine.lora
    return registry.names() if registry is not None else []


def adapter_of(engine: AsyncEngine, model: str | None) -> str | None:
    """The adapter a request's ``model`` names, or ``None`` (the base model)."""
    registry = engine.engine.lora
    return model if registry is not None and model in registry else None


class LoadLoRARequest(_Body):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRARequest(_Body):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


def build_lora_router(engine: AsyncEngine, base_model: str) -> APIRouter:
    """vLLM's load / unload routes (the caller mounts them behind the admin rule)."""
    router = APIRouter()

    def registry_or_400() -> Any:
        if engine.engine.lora is None:
            raise APIError("LoRA adapters are off: start the server with --enable-lora",
                           param="lora_name", code="lora_disabled")
        return engine.engine.lora

    @router.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load(body: LoadLoRARequest) -> str:
        registry = registry_or_400()
        if body.lora_name == base_model:
            raise APIError(f"lora_name {body.lora_name!r} is the base model's name",
                           param="lora_name")
        if body.lora_name in registry and not body.load_inplace:
            raise APIError(f"the lora adapter {body.lora_name!r} is already loaded (send "
                           "load_inplace: true to replace its weights)", param="lora_name")
        try:
            await engine.call(lambda e: registry.add(body.lora_name, body.lora_path))
        except ValueError as exc:
            raise APIError(str(exc), param="lora_path") from exc
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload(body: UnloadLoRARequest) -> str:
        registry = registry_or_400()
        if not await engine.call(lambda e: registry.remove(body.lora_name)):
            raise APIError(f"the lora adapter {body.lora_name!r} is not loaded", status=404,
                           param="lora_name", code="lora_not_found")
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router
