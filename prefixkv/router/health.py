"""Health probes, a prefixkv worker's cache figures, and the health loop.

``probe`` asks ``GET /health``; ``fetch_cache_stats`` reads ``GET /v1/cache/stats`` (prefixkv
workers only); ``health_loop`` probes every worker each interval and reports transitions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from prefixkv.router.workers import WorkerRegistry

__all__ = ["WorkerCacheStats", "fetch_cache_stats", "health_loop", "probe", "wait_until_healthy"]


async def probe(client: httpx.AsyncClient, url: str, timeout: float) -> str | None:
    """``GET url/health``: ``None`` when it answers 2xx in time, else the reason."""
    try:
        resp = await client.get(f"{url}/health", timeout=timeout)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if resp.status_code >= 300:
        return f"GET /health answered {resp.status_code}"
    return None


@dataclass(frozen=True, slots=True)
class WorkerCacheStats:
    """What a prefixkv worker's ``GET /v1/cache/stats`` says about its real cache."""

    capacity_tokens: int  # num_kv_blocks * block_size
    cached_blocks: int
    prompt_tokens: int  # prompt tokens it has processed since it started
    eviction_policy: str | None = None  # its index's policy name; None with caching off


async def fetch_cache_stats(
    client: httpx.AsyncClient, url: str, timeout: float, headers: dict[str, str] | None = None
) -> WorkerCacheStats | None:
    """The worker's cache figures, or ``None`` when it has no such endpoint (vLLM, SGLang),
    does not answer, refuses (an admin route: ``headers`` carry the fleet's admin key), or
    answers something else."""
    try:
        resp = await client.get(f"{url}/v1/cache/stats", timeout=timeout, headers=headers)
        d = resp.json()
    except (httpx.HTTPError, ValueError):
        return None
    if resp.status_code != 200 or not isinstance(d, dict):
        return None
    cache = d.get("cache")
    policy = cache.get("policy") if isinstance(cache, dict) else None
    try:
        return WorkerCacheStats(
            capacity_tokens=int(d["num_kv_blocks"]) * int(d["block_size"]),
            cached_blocks=int(d["num_cached_blocks"]),
            prompt_tokens=int(d["num_prompt_tokens"]),
            eviction_policy=policy if isinstance(policy, str) else None,
        )
    except (TypeError, KeyError, ValueError):
        return None


async def wait_until_healthy(
    client: httpx.AsyncClient, urls: Sequence[str], *, timeout: float, poll: float = 0.25
) -> None:
    """Wait until every URL answers ``/health``; ``RuntimeError`` naming those that did not."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    errors: dict[str, str] = {}
    while True:
        results = await asyncio.gather(*(probe(client, u, min(timeout, 5.0)) for u in pending))
        errors = {u: e for u, e in zip(pending, results) if e is not None}
        pending = list(errors)
        if not pending or time.monotonic() >= deadline:
            break
        await asyncio.sleep(poll)
    if pending:
        detail = "; ".join(f"{u}: {e}" for u, e in errors.items())
        raise RuntimeError(f"worker(s) not healthy after {timeout:g}s: {detail}")


async def health_loop(
    registry: WorkerRegistry,
    client: httpx.AsyncClient,
    *,
    interval: float,
    timeout: float,
    on_change: Callable[[str, bool], None],
) -> None:
    """Probe every worker each ``interval`` seconds, forever; ``on_change(url, healthy)`` on
    each transition (a worker that fails leaves the rotation, and returns once it answers)."""
    while True:
        await asyncio.sleep(interval)
        urls = registry.urls
        sent_at = registry.clock()
        results = await asyncio.gather(*(probe(client, u, timeout) for u in urls))
        for url, error in zip(urls, results):
            changed = (registry.mark_up(url, sent_at) if error is None
                       else registry.mark_down(url, error))
            if changed:
                on_change(url, error is None)
