"""One replay of a workload through a router, and its figures (:class:`PolicyResult`).

Owns sending scripted sessions to a router (:func:`replay`), emptying and waiting for workers,
and summarizing usage into a :class:`PolicyResult`, for prefixkv's router and for any other
router at a URL (:func:`run_external`). Imports the bench's meters and workloads, httpx lazily.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prefixkv.bench.route.meters import process_cpu, process_rss_mb, quantile
from prefixkv.bench.route.workloads import Workload

__all__ = ["PolicyResult", "ready", "replay", "reset_caches", "run_external", "summarize"]


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy's figures on one workload (times in seconds unless the name says)."""

    workload: str
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    cached_share: float
    seconds: float
    requests_per_s: float
    prompt_tokens_per_s: float
    per_worker: dict[str, int]
    max_min_load: float
    errors: int
    reasons: dict[str, int]
    p50_s: float
    p99_s: float
    policy_cpu_us: float
    router_cpu_ms: float | None
    rss_mb: float | None = None  # the router process's peak RSS (external routers)


async def replay(url: str | Sequence[str], workload: Workload, *, concurrency: int,
                 max_tokens: int,
                 model: str | None) -> tuple[list[dict[str, float]], Counter[str], int]:
    """Send every session's turns to ``url``, ``concurrency`` sessions at a time: per answered
    request its usage and latency, the requests per worker (from prefixkv's worker header;
    empty through other routers), and the count of failed requests. Several URLs (router
    replicas) take the requests in turn, round robin, as a load balancer in front would."""
    import httpx

    urls = [url] if isinstance(url, str) else list(url)
    sent = 0

    from prefixkv.router.app import WORKER_HEADER

    queue: asyncio.Queue[list[tuple[str, str]]] = asyncio.Queue()
    for s in workload.sessions:
        queue.put_nowait(s)
    usages: list[dict[str, float]] = []
    per_worker: Counter[str] = Counter()
    errors = 0

    async def run_sessions(client: httpx.AsyncClient) -> None:
        nonlocal errors, sent
        while not queue.empty():
            session = queue.get_nowait()
            messages: list[dict[str, str]] = [{"role": "system", "content": workload.system}]
            for user, assistant in session:
                messages.append({"role": "user", "content": user})
                body: dict[str, object] = {"messages": messages, "max_tokens": max_tokens,
                                           "temperature": 0.0}
                if model:
                    body["model"] = model
                target, sent = urls[sent % len(urls)], sent + 1
                t0 = time.perf_counter()
                try:
                    resp = await client.post(f"{target}/v1/chat/completions", json=body)
                except httpx.HTTPError:  # counted; the session goes on with its next turn
                    errors += 1
                    messages.append({"role": "assistant", "content": assistant})
                    continue
                latency = time.perf_counter() - t0
                if resp.status_code != 200:
                    errors += 1
                else:
                    usage = resp.json()["usage"]
                    details = usage.get("prompt_tokens_details") or {}
                    usages.append({"prompt": usage["prompt_tokens"],
                                   "cached": details.get("cached_tokens") or 0,
                                   "latency": latency})
                    if WORKER_HEADER in resp.headers:
                        per_worker[resp.headers[WORKER_HEADER]] += 1
                messages.append({"role": "assistant", "content": assistant})

    async with httpx.AsyncClient(timeout=600.0) as client:
        await asyncio.gather(*(run_sessions(client) for _ in range(concurrency)))
    return usages, per_worker, errors


async def reset_caches(urls: Sequence[str]) -> None:
    """Empty each prefixkv worker's cache (others are left as they are)."""
    import httpx

    async with httpx.AsyncClient(timeout=60.0) as client:
        for u in urls:
            try:
                await client.post(f"{u}/v1/cache/reset")
            except httpx.HTTPError:
                pass  # not a prefixkv worker: its cache stays as it is


async def ready(urls: Sequence[str], timeout: float = 300.0) -> None:
    """Wait until every URL answers ``/health`` (``timeout`` seconds at most, then
    ``RuntimeError``)."""
    import httpx

    from prefixkv.router.health import wait_until_healthy

    async with httpx.AsyncClient() as client:
        await wait_until_healthy(client, urls, timeout=timeout)


def summarize(workload: str, policy: str, usages: Sequence[dict[str, float]],
              per_worker: Mapping[str, int], errors: int, seconds: float, *,
              reasons: dict[str, int], workers: Sequence[str], policy_cpu_us: float,
              router_cpu_ms: float | None, rss_mb: float | None = None) -> PolicyResult:
    """One replay's figures from what :func:`replay` returned."""
    prompt = int(sum(u["prompt"] for u in usages))
    cached = int(sum(u["cached"] for u in usages))
    latencies = [u["latency"] for u in usages]
    counts = {u: per_worker.get(u, 0) for u in workers}
    lo, hi = (min(counts.values()), max(counts.values())) if counts else (0, 0)
    return PolicyResult(
        workload=workload, policy=policy, requests=len(usages), prompt_tokens=prompt,
        cached_tokens=cached, computed_tokens=prompt - cached,
        cached_share=cached / prompt if prompt else 0.0,
        seconds=seconds, requests_per_s=len(usages) / seconds,
        prompt_tokens_per_s=prompt / seconds, per_worker=counts,
        max_min_load=hi / lo if lo else float("inf"), errors=errors, reasons=reasons,
        p50_s=quantile(latencies, 0.5), p99_s=quantile(latencies, 0.99),
        policy_cpu_us=policy_cpu_us, router_cpu_ms=router_cpu_ms, rss_mb=rss_mb,
    )


async def _finished(urls: Sequence[str]) -> dict[str, int | None]:
    """Each prefixkv worker's ``num_requests_finished`` (``None`` when it does not say)."""
    import httpx

    out: dict[str, int | None] = {}
    async with httpx.AsyncClient(timeout=30.0) as client:
        for u in urls:
            try:
                out[u] = int((await client.get(f"{u}/v1/cache/stats")).json()
                             ["num_requests_finished"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                out[u] = None
    return out


async def _served_model(url: str) -> str | None:
    """The first model id a worker lists (Rust routers need ``model`` in the body)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            return str((await client.get(f"{url}/v1/models")).json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def run_external(url: str, label: str, worker_urls: Sequence[str], workload: Workload,
                 args: argparse.Namespace, workload_name: str = "chat",
                 pid: int | None = None) -> PolicyResult:
    """Replay ``workload`` through the router at ``url`` (reported as policy ``label``)."""
    url = url.rstrip("/")
    model = args.model
    if worker_urls:
        asyncio.run(reset_caches(worker_urls))
        model = asyncio.run(_served_model(worker_urls[0])) or model
    before = asyncio.run(_finished(worker_urls))
    cpu0 = None if pid is None else process_cpu(pid)
    t0 = time.perf_counter()
    usages, per_worker, errors = asyncio.run(replay(
        url, workload, concurrency=args.concurrency, max_tokens=args.max_tokens, model=model))
    seconds = time.perf_counter() - t0
    cpu1 = None if pid is None else process_cpu(pid)
    if not per_worker and worker_urls:  # a foreign router: count at the workers
        after = asyncio.run(_finished(worker_urls))
        per_worker.update({u: (after[u] or 0) - (before[u] or 0) for u in worker_urls
                           if after[u] is not None and before[u] is not None})
    n = max(1, len(usages))
    return summarize(
        workload_name, label, usages, per_worker, errors, seconds, reasons={},
        workers=list(worker_urls) or sorted(per_worker), policy_cpu_us=0.0,
        router_cpu_ms=None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / n * 1e3,
        rss_mb=None if pid is None else process_rss_mb(pid),
    )
