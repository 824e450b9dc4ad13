"""Tenancy on every route (issue 40, item 6): ``cache_salt`` and SGLang's ``extra_key`` keep one
tenant's cached prompt from another on every route that takes a prompt and reads the cache.

The route list is the app's own: a new route that is neither tenant-tested here nor exempt
(with its reason) fails :func:`test_every_route_is_tenant_tested_or_exempt`, so a new
prompt-taking route cannot forget the salt (``/v1/messages`` and ``/v1/responses`` once did:
tenant B read tenant A's prompt from the cache).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from server_live import LiveServer, unique_text

Body = Callable[[str], dict[str, Any]]
Cached = Callable[[dict[str, Any]], int]

TENANT_ROUTES: dict[str, tuple[Body, Cached]] = {
    "/v1/completions": (
        lambda p: {"prompt": p, "max_tokens": 1},
        lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]),
    "/v1/chat/completions": (
        lambda p: {"messages": [{"role": "user", "content": p}], "max_tokens": 1},
        lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]),
    "/v1/messages": (
        lambda p: {"messages": [{"role": "user", "content": p}], "max_tokens": 1},
        lambda r: r["usage"]["cache_read_input_tokens"]),
    "/v1/responses": (
        lambda p: {"input": p, "max_output_tokens": 1, "store": False},
        lambda r: r["usage"]["input_tokens_details"]["cached_tokens"]),
    "/generate": (
        lambda p: {"text": p, "sampling_params": {"max_new_tokens": 1}},
        lambda r: r["meta_info"]["cached_tokens"]),
}
"""Routes that run a prompt through the cache: each gets the tenant check below."""

EXEMPT: dict[str, str] = {
    "/v1/completions/render": "renders the prompt to token ids; reads no cache",
    "/v1/chat/completions/render": "renders the prompt to token ids; reads no cache",
    "/v1/messages/count_tokens": "counts tokens; reads no cache",
    "/tokenize": "tokenizes; reads no cache",
    "/detokenize": "takes token ids, decodes them; reads no cache",
    "/v1/cache/pin": "admin (the operator's): names the tenant with its own cache_salt field",
    "/v1/cache/unpin": "admin (the operator's): names the tenant with its own cache_salt field",
    "/v1/cache/lookup": "admin (the operator's): names the tenant with its own cache_salt field",
    "/v1/cache/reset": "admin: no prompt", "/reset_prefix_cache": "admin: no prompt",
    "/flush_cache": "admin: no prompt", "/v1/cache/stats": "no prompt",
    "/v1/cache/pinned": "no prompt", "/v1/load_lora_adapter": "admin: no prompt",
    "/v1/unload_lora_adapter": "admin: no prompt", "/health_generate": "fixed probe prompt",
    "/health": "no prompt", "/ping": "no prompt", "/metrics": "no prompt",
    "/version": "no prompt", "/v1/models": "no prompt", "/v1/models/{model_id}": "no prompt",
    "/model_info": "no prompt", "/get_model_info": "no prompt", "/server_info": "no prompt",
    "/get_server_info": "no prompt", "/tokenizer_info": "no prompt", "/kv_events": "no prompt",
    "/v1/responses/{response_id}": "reads a stored response",
    "/v1/responses/{response_id}/input_items": "reads a stored response",
}
"""Routes that take no prompt, or take one without reading the cache, and why."""


def _app_paths(server: LiveServer) -> set[str]:
    """Every route path of the app: the OpenAPI paths plus any plain route outside the schema."""
    app: Any = server.server.config.app
    paths = set(app.openapi()["paths"])
    paths |= {r.path for r in app.routes if isinstance(r, APIRoute)}
    return paths


def test_every_route_is_tenant_tested_or_exempt(server: LiveServer) -> None:
    paths = _app_paths(server)
    assert len(paths) > 20  # the enumeration sees the included routers, not just the top level
    unknown = paths - set(TENANT_ROUTES) - set(EXEMPT)
    assert not unknown, f"new routes: add each to TENANT_ROUTES (takes a prompt) or EXEMPT: {unknown}"
    assert set(TENANT_ROUTES) <= paths  # nothing tested here has gone


@pytest.mark.parametrize("key", ["cache_salt", "extra_key"])
@pytest.mark.parametrize("path", sorted(TENANT_ROUTES))
def test_one_tenant_never_reads_anothers_prompt_from_the_cache(
    http: httpx.Client, path: str, key: str
) -> None:
    body, cached = TENANT_ROUTES[path]
    prompt = unique_text(f"{uuid.uuid4().hex} tenant {path} {key}", n_words=60)  # unique from the start
    a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"

    def send(salt: str | None) -> int:
        r = http.post(path, json={**body(prompt), **({key: salt} if salt else {})})
        assert r.status_code == 200, r.text
        return cached(r.json())

    assert send(a) == 0
    assert send(a) > 0  # the route caches: tenant A reads its own prompt back
    assert send(b) == 0  # tenant B does not read A's
    assert send(None) == 0  # nor does a request without a salt
