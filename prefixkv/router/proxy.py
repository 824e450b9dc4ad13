"""The router's proxy core: :class:`Router` sends each request to the worker its policy picks.

Contract. :class:`Router` owns the worker registry (health, in-flight load), the policy and its
approximate prefix trees, the router metrics and the HTTP client to the workers. It forwards a
request body unchanged to one worker and returns the worker's answer (SSE streams passed through
as they arrive) with an ``x-prefixkv-worker`` header naming the worker. It parses no request
bodies: the HTTP front (:mod:`prefixkv.router.app`) validates them and builds the route keys.

Failures. A dispatch that fails before the worker starts answering (connection refused or reset,
the worker died) or that the worker answers with a 5xx is sent again to another healthy worker,
each worker at most once per request; nothing has reached the client yet, so streamed requests
are retried too. A connection failure also takes the worker out of rotation until its
``/health`` answers again (the health loop); requests still waiting on a worker that leaves the
rotation (it stopped answering its probes) are abandoned there and sent elsewhere. A stream that
breaks midway (or whose worker leaves the rotation) ends with an SSE error event. Only when every
healthy worker failed does the client see the error (503 if none was left).

Load. A worker's in-flight count rises when a request is sent to it and falls when that attempt
is over: answer read, attempt failed, or stream ended (a stream's relay owns the count).

Sharpening. For prefixkv workers the router also reads ``GET /v1/cache/stats`` every health
interval and aligns the worker's approximate tree with its real cache (see ``Router._sharpen``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixkv.router.metrics import RouterMetrics
from prefixkv.router.policies import POLICY_NAMES, make_policy
from prefixkv.router.tree import PrefixTrees, RouteKey
from prefixkv.router.workers import (
    WorkerCacheStats,
    WorkerRegistry,
    fetch_cache_stats,
    health_loop,
    normalize_worker_url,
    probe,
)

log = logging.getLogger("prefixkv.router")

T = TypeVar("T")
WORKER_HEADER = "x-prefixkv-worker"
_FORWARDED_HEADERS = ("authorization", "x-request-id")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs, validated once (``ValueError`` naming the bad field).

    Times are in seconds. ``eviction_interval == 0`` trims the trees after every insert.
    """

    worker_urls: tuple[str, ...]
    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**18
    eviction_interval: float = 60.0
    health_check_interval: float = 10.0
    health_check_timeout: float = 5.0
    request_timeout: float = 600.0
    seed: int | None = field(default=None)

    def __post_init__(self) -> None:
        urls = tuple(normalize_worker_url(u) for u in self.worker_urls)
        object.__setattr__(self, "worker_urls", urls)
        if not urls:
            raise ValueError("worker_urls must name at least one worker")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {list(POLICY_NAMES)}, got {self.policy!r}")
        if self.max_tree_size <= 0:
            raise ValueError(f"max_tree_size must be > 0, got {self.max_tree_size!r}")
        for name in ("health_check_interval", "health_check_timeout", "request_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


class WorkerGone(Exception):
    """A request's worker left the rotation before answering (raised by ``Router._send``)."""


def error_body(message: str, *, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, dict[str, str | None]]:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, *, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-style error answer with HTTP status ``status``."""
    return JSONResponse(error_body(message, type_=type_, param=param, code=code),
                        status_code=status)


class Router:
    """Owns the worker registry, the policy (and its trees), the metrics and the HTTP client.

    :meth:`start` / :meth:`stop` run inside the app's lifespan; everything else runs on its loop.
    """

    def __init__(self, config: RouterConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.workers = WorkerRegistry(config.worker_urls)
        self.trees: PrefixTrees | None = None
        if config.policy == "cache_aware":
            self.trees = PrefixTrees(
                self.workers.urls, max_size=config.max_tree_size,
                eviction_interval=config.eviction_interval, clock=clock,
            )
        self.policy = make_policy(
            config.policy, trees=self.trees, cache_threshold=config.cache_threshold,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
            rng=random.Random(config.seed),
        )
        self.metrics = RouterMetrics(config.policy)
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # set when a worker leaves the rotation: requests waiting on it are sent elsewhere
        self._gone = {url: asyncio.Event() for url in self.workers.urls}
        # key elements routed to each worker, and (elements, worker prompt tokens) when its
        # cache stats were first seen: their growth gives key elements per worker token
        self._routed = dict.fromkeys(self.workers.urls, 0)
        self._baseline: dict[str, tuple[int, int]] = {}

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("router not started")
        return self._client

    async def start(self) -> None:
        """Open the client, probe every worker once, start the health and trim loops."""
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.request_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        cfg = self.config
        results = await asyncio.gather(
            *(probe(self.client, u, cfg.health_check_timeout) for u in self.workers.urls)
        )
        for url, error in zip(self.workers.urls, results):
            if error is not None:
                self._set_health(url, False, error)
        self._tasks.append(asyncio.create_task(health_loop(
            self.workers, self.client, interval=cfg.health_check_interval,
            timeout=cfg.health_check_timeout, on_change=self._on_health_change,
        )))
        if self.trees is not None:
            self._tasks.append(asyncio.create_task(self._sharpen_loop(self.trees)))
            if cfg.eviction_interval > 0:
                self._tasks.append(asyncio.create_task(self._trim_loop(self.trees)))

    async def stop(self) -> None:
        """Cancel the loops and close the client."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()

    async def _trim_loop(self, trees: PrefixTrees) -> None:
        while True:
            await asyncio.sleep(self.config.eviction_interval)
            evicted = trees.trim()
            log.debug("trimmed %d elements from the approximate trees", evicted)

    async def _sharpen_loop(self, trees: PrefixTrees) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.health_check_interval)
            urls = self.workers.healthy()
            stats = await asyncio.gather(
                *(fetch_cache_stats(self.client, u, cfg.health_check_timeout) for u in urls)
            )
            for url, st in zip(urls, stats):
                if st is not None:
                    self._sharpen(trees, url, st)

    def _sharpen(self, trees: PrefixTrees, url: str, st: WorkerCacheStats) -> None:
        """Align ``url``'s tree with its prefixkv worker's real cache: bound it by the worker's
        KV capacity (in key elements, at the measured elements-per-token rate, once 1,000 prompt
        tokens were seen), and empty it when the worker's cache is empty with nothing in flight
        (an admin reset, a quick restart, or prefix caching off)."""
        routed = self._routed[url]
        base = self._baseline.get(url)
        if base is None or st.prompt_tokens < base[1]:  # first look, or the worker restarted
            self._baseline[url] = base = (routed, st.prompt_tokens)
        tokens = st.prompt_tokens - base[1]
        if tokens >= 1000 and routed > base[0]:
            trees.set_max_size(url, int(st.capacity_tokens * (routed - base[0]) / tokens))
        if st.cached_blocks == 0 and self.workers[url].in_flight == 0:
            trees.reset(url)

    def _on_health_change(self, url: str, healthy: bool) -> None:
        self._baseline.pop(url, None)
        if healthy:
            self._gone[url] = asyncio.Event()
        else:
            self._gone[url].set()
        if self.trees is not None:
            self.trees.reset(url)  # down: its cache is gone or unknown; up: starts empty
        if not healthy:
            self.metrics.observe_failure(url, "probe")
        log.warning("worker %s is %s", url, "back in rotation" if healthy else "out of rotation")

    def _set_health(self, url: str, healthy: bool, error: str = "") -> None:
        changed = self.workers.mark_up(url) if healthy else self.workers.mark_down(url, error)
        if changed:
            self._on_health_change(url, healthy)

    async def _until_gone(self, url: str, step: Awaitable[T]) -> T:
        """Await ``step`` (a send, a chunk read) on ``url``'s connection, abandoning it with
        :class:`WorkerGone` if ``url`` leaves the rotation first (so a hung worker holds no
        request until the request timeout)."""
        task = asyncio.ensure_future(step)
        gone = asyncio.ensure_future(self._gone[url].wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():  # the worker left, or this request was cancelled
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if task.cancelled():
            raise WorkerGone(url)
        return task.result()

    async def dispatch(self, path: str, raw: bytes, key: RouteKey, stream: bool,
                       headers: Mapping[str, str]) -> Response:
        """Send one request to a worker, retrying on others as the module docstring says."""
        fwd = {h: headers[h] for h in _FORWARDED_HEADERS if h in headers}
        fwd["content-type"] = "application/json"
        tried: list[str] = []
        last_5xx: Response | None = None
        while urls := self.workers.healthy(exclude=tried):
            decision = self.policy.select(urls, self.workers.loads(), key)
            url = decision.url
            if tried:
                self.metrics.retries.inc()
            tried.append(url)
            self.metrics.observe_dispatch(url, decision.reason, decision.match_ratio)
            self._routed[url] += len(key)
            self.workers.begin(url)
            request = self.client.build_request("POST", url + path, content=raw, headers=fwd)
            relayed = False  # once True, _relay owns resp and the in-flight count
            try:
                resp = await self._until_gone(url, self.client.send(request, stream=True))
                if resp.status_code < 500 and stream:
                    relayed = True
                    return StreamingResponse(
                        self._relay(resp, url), status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"),
                        headers={WORKER_HEADER: url},
                    )
                try:
                    content = await self._until_gone(url, resp.aread())
                finally:
                    await resp.aclose()
            except httpx.TransportError as exc:
                self.metrics.observe_failure(url, "connect")
                self._set_health(url, False, f"{type(exc).__name__}: {exc}")
                continue
            except WorkerGone:
                self.metrics.observe_failure(url, "abandoned")
                continue
            finally:
                if not relayed:
                    self.workers.end(url)
            answer = Response(
                content, status_code=resp.status_code,
                media_type=resp.headers.get("content-type"), headers={WORKER_HEADER: url},
            )
            if resp.status_code < 500:
                return answer
            self.metrics.observe_failure(url, "status_5xx")
            last_5xx = answer
        if last_5xx is not None:
            return last_5xx
        self.metrics.unroutable.inc()
        return error_response(503, "no healthy worker is available", type_="service_unavailable",
                              code="no_healthy_worker")

    async def _relay(self, resp: httpx.Response, url: str) -> AsyncIterator[bytes]:
        """Pass a worker's stream through; owns ``resp`` and the worker's in-flight count."""
        chunks = resp.aiter_raw()
        try:
            while True:
                try:
                    chunk = await self._until_gone(url, anext(chunks))
                except StopAsyncIteration:
                    break
                yield chunk
        except (httpx.TransportError, WorkerGone) as exc:
            self.metrics.observe_failure(url, "stream")
            if isinstance(exc, httpx.TransportError):
                self._set_health(url, False, f"{type(exc).__name__}: {exc}")
            err = error_body(f"worker {url} failed mid-stream: {exc}", type_="worker_error",
                             code="worker_failed")
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await resp.aclose()
            self.workers.end(url)

    async def models(self) -> Response:
        """``GET /v1/models`` answered by the first healthy worker that answers."""
        for url in self.workers.healthy():
            with contextlib.suppress(httpx.HTTPError):
                resp = await self.client.get(f"{url}/v1/models")
                if resp.status_code < 500:
                    return Response(resp.content, status_code=resp.status_code,
                                    media_type=resp.headers.get("content-type"))
        return error_response(503, "no healthy worker is available", type_="service_unavailable",
                              code="no_healthy_worker")

    def describe(self) -> list[dict[str, Any]]:
        """The router's view of each worker (``GET /workers``)."""
        sizes = self.trees.sizes() if self.trees is not None else {}
        bounds = self.trees.max_sizes() if self.trees is not None else {}
        return [
            {"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight, "routed": w.routed,
             "failures": w.failures, "last_error": w.last_error, "tree_size": sizes.get(w.url),
             "tree_bound": bounds.get(w.url)}
            for w in self.workers.all()
        ]
