"""The router's proxy core: :class:`Router` sends each request to the worker its policy picks.

Contract. :class:`Router` owns the worker registry (load, circuit breakers), the policy (which
owns its own state, e.g. the cache-aware trees), the router metrics, the keep-alive connection
pool that carries the proxied requests (:mod:`prefixkv.router.upstream`) and an httpx client for
probes, stats, tokenizing and admin routes. It forwards a request body unchanged to one worker and returns the worker's answer (SSE
streams passed through as they arrive) with an ``x-prefixkv-worker`` header naming the worker. It
parses no request bodies: the HTTP front (:mod:`prefixkv.router.app`) validates them and builds
the route keys.

Failures. An answer the worker blames on the request is passed to the client as it is (status
and body), never retried, and does not count against the worker: every 4xx, and a 5xx that
carries ``X-Prefixkv-Error-Cause: request``. A dispatch that fails before the worker starts
answering (connection refused, reset or dropped: the worker died) or that gets any other 5xx
(e.g. 503 from a dead engine) is sent again to another healthy worker, each worker at most once
per request; nothing has reached the client yet, so streamed requests are retried too. Such a
failure counts towards the worker's circuit breaker and triggers an immediate ``/health`` probe
(see :mod:`prefixkv.router.workers`). A connection cut after the request was sent is probed at
once: a worker gone died under the request, which may have killed it (a query of death). Judged
by the death as first noticed (:mod:`prefixkv.router.deaths`: one record and one probe per death,
requests abandoned there by it included): alone there then, or the one request there whose body
had a strike, it is pinned: not retried (502), its
body fingerprint quarantined (identical requests answered 503 ``request_quarantined`` for
``quarantine_ttl`` s); else it is retried once with a strike, one struck request per worker
(:mod:`prefixkv.router.quarantine`): a poison request costs one worker alone, at most two
among others. Requests still waiting on a worker that leaves the
rotation (it stopped answering its probes) are abandoned there and sent elsewhere. A stream that
breaks midway (or whose worker leaves the rotation) ends with an SSE error event. Only when every
healthy worker failed does the client see the error (503 if none was left).

Cancellation. When the client goes away, the HTTP front cancels :meth:`Router.dispatch` or the
relay of its streamed :class:`~prefixkv.router.answer.Answer`; either way the upstream
connection is aborted at once, so the worker sees its client leave and aborts the request.

Conversations. A Responses API answer stored on its worker names its id in a header; a later
request continuing it (``previous_response_id``) goes to that worker while it is healthy, the
only one holding the conversation (elsewhere the worker answers 404), and so do ``GET`` /
``DELETE /v1/responses/{id}`` (:mod:`prefixkv.router.conversations`).

Load. A worker's in-flight count rises when a request is sent to it and falls when that attempt
is over: answer read, attempt failed or cancelled, or stream ended (a stream's relay owns it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import httpx
from fastapi.responses import Response

from prefixkv.router.admin import admin_headers
from prefixkv.router.answer import Answer, error_answer
from prefixkv.router.config import RouterConfig
from prefixkv.router.conversations import StoredResponses
from prefixkv.router.deaths import Deaths, Verdict
from prefixkv.router.errors import error_body, error_response
from prefixkv.router.health import WorkerCacheStats, fetch_cache_stats, health_loop, probe
from prefixkv.router.keys import RouteKey
from prefixkv.router.metrics import RouterMetrics
from prefixkv.router.policies import Policy, make_policy
from prefixkv.router.quarantine import Quarantine, fingerprint
from prefixkv.router.upstream import UpstreamError, UpstreamPool, UpstreamResponse, WorkerGone
from prefixkv.router.workers import WorkerRegistry

log = logging.getLogger("prefixkv.router")

WORKER_HEADER = "x-prefixkv-worker"
_FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")  # W3C trace
ERROR_CAUSE_HEADER = "x-prefixkv-error-cause"


class Router:
    """Owns the worker registry, the policy, the metrics and the HTTP client.

    :meth:`start` / :meth:`stop` run inside the app's lifespan; everything else runs on its loop.
    """

    def __init__(self, config: RouterConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.workers = WorkerRegistry(config.worker_urls,
                                      failure_threshold=config.failure_threshold)
        self.policy: Policy = make_policy(
            config.policy, self.workers.urls, cache_threshold=config.cache_threshold,
            balance_abs_threshold=config.balance_abs_threshold,
            balance_rel_threshold=config.balance_rel_threshold,
            balance_window=config.balance_window, max_tree_size=config.max_tree_chunks,
            eviction_interval=config.eviction_interval, rng=random.Random(config.seed),
            clock=clock, simulate_eviction=config.simulate_eviction,
            capacity_tokens=config.capacity_tokens, load_factor=config.load_factor,
            worker_eviction_policy=config.worker_eviction_policy,
            hash_prefix_chunks=config.hash_prefix_chunks, hash_replicas=config.hash_replicas,
            kv_events=config.kv_events, kv_events_topic=config.kv_events_topic,
            kv_events_rehash=config.kv_events_rehash, kv_tier_weights=config.kv_tier_weights,
        )
        self.metrics = RouterMetrics()
        self.quarantine = Quarantine(config.quarantine_ttl, config.quarantine_size)
        self.deaths = Deaths(self.quarantine, self._probe, self._on_death)
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._probing: dict[str, asyncio.Task[None]] = {}
        # requests waiting on a worker that leaves the rotation are sent elsewhere (abandon)
        self.pool = UpstreamPool(timeout=config.request_timeout)
        self.stored = StoredResponses()  # Responses API conversations: id -> its worker

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("router not started")
        return self._client

    async def start(self) -> None:
        """Open the client, probe every worker and read its stats once, start the health and
        stats loops."""
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.request_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        cfg = self.config
        results = await asyncio.gather(
            *(probe(self.client, u, cfg.health_check_timeout) for u in self.workers.urls)
        )
        for url, error in zip(self.workers.urls, results):
            if error is not None and self.workers.mark_down(url, error):
                self._on_health_change(url, False)
        self._tasks.append(asyncio.create_task(health_loop(
            self.workers, self.client, interval=cfg.health_check_interval,
            timeout=cfg.health_check_timeout, on_change=self._on_health_change,
        )))
        await self._read_stats()  # before any request: a policy may rebuild its trees on it
        self._tasks.append(asyncio.create_task(self._stats_loop()))
        start_policy = getattr(self.policy, "start", None)  # precise: its KV event streams
        if start_policy is not None:
            await start_policy(self.client)

    async def stop(self) -> None:
        """Cancel the loops and probes and close the client."""
        tasks = self._tasks + list(self._probing.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._probing.clear()
        self.deaths.close()
        stop_policy = getattr(self.policy, "stop", None)
        if stop_policy is not None:
            await stop_policy()
        if self._client is not None:
            await self._client.aclose()
        self.pool.close()

    async def _stats_loop(self) -> None:
        """Every health interval, hand each healthy prefixkv worker's cache figures to the
        policy (workers without ``/v1/cache/stats`` are left alone)."""
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self._read_stats()

    async def _read_stats(self) -> None:
        cfg = self.config
        urls = self.workers.healthy()
        stats = await asyncio.gather(
            *(fetch_cache_stats(self.client, u, cfg.health_check_timeout,
                                admin_headers(cfg.admin_api_key)) for u in urls)
        )
        for url, st in zip(urls, stats):
            if st is not None:
                self.on_worker_stats(url, st)

    def on_worker_stats(self, url: str, stats: WorkerCacheStats) -> None:
        """Pass a worker's cache figures (with its in-flight count) to the policy."""
        self.policy.on_worker_stats(url, stats, self.workers[url].in_flight)

    def _on_health_change(self, url: str, healthy: bool) -> None:
        if healthy:
            self.pool.readmit(url)
            self.deaths.revived(url)
        else:
            self.pool.abandon(url)
            self.metrics.observe_failure(url, "probe")
        self.policy.on_worker_health(url, healthy)
        log.warning("worker %s is %s", url, "back in rotation" if healthy else "out of rotation")

    def dispatch_failed(self, url: str, kind: str, error: str) -> None:
        """Count a failed dispatch against ``url``'s breaker and probe it at once; the policy
        (if it keeps a dispatch window) forgets it."""
        self.metrics.observe_failure(url, kind)
        forget = getattr(self.policy, "on_dispatch_failed", None)
        if forget is not None and kind != "stream":  # a stream that failed mid-way was work
            forget(url)
        if self.workers.record_failure(url, error):
            self._on_health_change(url, False)
        elif self.workers[url].healthy and url not in self._probing:
            task = asyncio.create_task(self._probe_now(url))
            self._probing[url] = task

    async def _probe(self, url: str) -> str | None:
        return await probe(self.client, url, self.config.health_check_timeout)

    def _on_death(self, url: str, error: str) -> None:
        """``url`` died under requests (its probe failed after a cut): out of the rotation."""
        self.metrics.observe_failure(url, "died")
        forget = getattr(self.policy, "on_dispatch_failed", None)
        if forget is not None:
            forget(url)
        if self.workers.mark_down(url, error):
            self._on_health_change(url, False)

    async def _judge(self, url: str, fp: str, sent: int, error: str, *,
                     cut: bool) -> Verdict | None:
        """The verdict on attempt ``sent`` (fingerprint ``fp``), cut or abandoned on ``url``
        (:mod:`prefixkv.router.deaths`); a death pinned on it is counted and logged."""
        verdict = await self.deaths.judge(url, fp, sent, in_flight=self.workers[url].in_flight,
                                          error=error, cut=cut)
        if verdict is Verdict.PINNED:
            self.metrics.request_deaths.labels(url).inc()
            log.error("worker %s died serving request %s (%s); requests with that body are "
                      "quarantined for %g s", url, fp, error, self.config.quarantine_ttl)
        return verdict

    async def _probe_now(self, url: str) -> None:
        try:
            error = await probe(self.client, url, self.config.health_check_timeout)
            if error is not None and self.workers.mark_down(url, error):
                self._on_health_change(url, False)
        finally:
            self._probing.pop(url, None)

    async def refine_key(self, path: str, body: Mapping[str, Any], key: RouteKey,
                         headers: Mapping[str, str]) -> RouteKey:
        """``key`` as the policy wants it before choosing (``precise``: with token ids)."""
        annotate = getattr(self.policy, "annotate", None)
        if annotate is None:
            return key
        refined: RouteKey = await annotate(self.client, self.workers.healthy(), path, body, key,
                                           headers)
        return refined

    async def dispatch(self, path: str, raw: bytes, key: RouteKey, stream: bool,
                       headers: Mapping[str, str], *, after: str | None = None) -> Answer:
        """Send one request to a worker, retrying on others as the module docstring says.

        ``after``: the stored response a Responses API request continues
        (``previous_response_id``); it goes to the worker that answered it while that one is
        healthy (only it holds the conversation), bypassing the policy."""
        fp = fingerprint("POST", path, raw)
        fwd = {h: headers[h] for h in _FORWARDED_HEADERS if h in headers}
        fwd["content-type"] = "application/json"
        tried: list[str] = []
        last_5xx: Answer | None = None
        holder = self.stored.holder(after)
        while urls := self.workers.healthy(exclude=tried):
            left = self.quarantine.refused_for(fp)
            if left is not None:
                self.metrics.quarantined.inc()
                return _quarantined(503, "request quarantined: a worker died serving a request "
                                    "with the same method, path and body; refused for another "
                                    f"{left:.0f} s")
            suspect = self.quarantine.has_strike(fp)
            if suspect:  # one per worker at a time, so a death with one in flight names it
                if not (urls := self.quarantine.without_suspects(urls)):
                    await self.quarantine.wait_for_room(self.config.health_check_interval)
                    continue
            ratio: float | None = None
            if holder in urls:
                url, reason = holder, "conversation"
            else:
                decision = self.policy.select(urls, self.workers.loads(), key)
                url, reason, ratio = decision.url, decision.reason, decision.match_ratio
            if tried:
                self.metrics.retries.inc()
            tried.append(url)
            self.metrics.observe_dispatch(url, reason, ratio)
            self.workers.begin(url)
            sent = self.deaths.sent()
            if suspect:
                self.quarantine.hold(url, fp)
            relayed = False  # once True, the answer's stream owns resp and the in-flight count
            try:
                resp = await self.pool.post(url, path, raw, fwd)
                retry = _worker_caused(resp)
                self.stored.remember(resp.headers, resp.status, url)
                if stream and not retry:
                    relayed = True
                    self.workers.record_success(url)
                    return self._relay(resp, url, fp, suspect, sent)
                content = await resp.read()
            except (UpstreamError, WorkerGone) as exc:
                error = f"{type(exc).__name__}: {exc}"
                cut = isinstance(exc, UpstreamError) and exc.cut
                verdict = await self._judge(url, fp, sent, error, cut=cut)
                if verdict is None and isinstance(exc, WorkerGone):
                    self.metrics.observe_failure(url, "abandoned")
                    forget = getattr(self.policy, "on_dispatch_failed", None)
                    if forget is not None:
                        forget(url)
                elif verdict is None:
                    self.dispatch_failed(url, "connect", error)
                elif verdict is Verdict.PINNED:
                    self.metrics.quarantined.inc()
                    return _quarantined(502, f"worker {url} died while serving this request; it "
                                        "was not retried, and requests with the same method, path "
                                        f"and body are refused for {self.config.quarantine_ttl:g} "
                                        "s (quarantined)")
                continue
            finally:
                if not relayed:
                    self.workers.end(url)
                    if suspect:
                        self.quarantine.release(url)
            answer = Answer(resp.status, _answer_headers(resp, url), content)
            if not retry:
                self.workers.record_success(url)
                return answer
            self.dispatch_failed(url, "status_5xx", f"answered {resp.status}")
            last_5xx = answer
        if last_5xx is not None:
            return last_5xx
        self.metrics.unroutable.inc()
        return error_answer(503, "no healthy worker is available", type_="service_unavailable",
                            code="no_healthy_worker")

    async def stored_response(self, method: str, response_id: str, headers: Mapping[str, str],
                              rest: str = "") -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}`` from the worker holding it
        (:meth:`StoredResponses.forward`)."""
        fwd = {h: headers[h] for h in _FORWARDED_HEADERS if h in headers}
        return await self.stored.forward(self.client, self.workers.healthy(), method,
                                         response_id, fwd, rest)

    def _relay(self, resp: UpstreamResponse, url: str, fp: str, suspect: bool,
               sent: int) -> Answer:
        """A streamed answer passing the worker's pieces through; it owns ``resp`` and the
        worker's in-flight count (released once, by the stream's end or the answer's close)."""
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.workers.end(url)
                if suspect:
                    self.quarantine.release(url)
                resp.close()

        async def relay() -> AsyncGenerator[bytes, None]:
            pieces = resp.chunks()
            try:
                async for piece in pieces:
                    yield piece
            except (UpstreamError, WorkerGone) as exc:
                message = f"worker {url} failed mid-stream: {exc}"
                error = f"{type(exc).__name__}: {exc}"
                cut = isinstance(exc, UpstreamError) and exc.cut
                verdict = await self._judge(url, fp, sent, error, cut=cut)
                if verdict is Verdict.PINNED:
                    message = (f"worker {url} died while serving this request; requests with "
                               "the same method, path and body are refused for "
                               f"{self.config.quarantine_ttl:g} s (quarantined)")
                elif verdict is None and isinstance(exc, UpstreamError):
                    self.dispatch_failed(url, "stream", error)
                elif verdict is None:
                    self.metrics.observe_failure(url, "stream")
                err = error_body(message, type_="worker_error", code="worker_failed")
                yield f"data: {json.dumps(err)}\n\n".encode()
            finally:
                end()
                await pieces.aclose()

        return Answer(resp.status, _answer_headers(resp, url), stream=relay(), close=end)

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
        """The router's view of each worker (``GET /workers``), with the policy's fields."""
        extra = self.policy.describe()
        return [
            {"url": w.url, "healthy": w.healthy, "breaker": w.state, "in_flight": w.in_flight,
             "routed": w.routed, "failures": w.failures, "last_error": w.last_error,
             **extra.get(w.url, {})}
            for w in self.workers.all()
        ]


def _quarantined(status: int, message: str) -> Answer:
    """The answer for a request whose body is quarantined (blamed on the request: a router in
    front of this one does not retry it either)."""
    answer = error_answer(status, message, type_="service_unavailable", code="request_quarantined")
    answer.headers[ERROR_CAUSE_HEADER] = "request"
    return answer


def _worker_caused(resp: UpstreamResponse) -> bool:
    """A 5xx the worker did not blame on the request (those are retried elsewhere)."""
    return resp.status >= 500 and resp.headers.get(ERROR_CAUSE_HEADER) != "request"


def _answer_headers(resp: UpstreamResponse, url: str) -> dict[str, str]:
    headers = {WORKER_HEADER: url}
    content_type = resp.headers.get("content-type")
    if content_type is not None:
        headers["content-type"] = content_type
    cause = resp.headers.get(ERROR_CAUSE_HEADER)
    if cause is not None:
        headers[ERROR_CAUSE_HEADER] = cause
    return headers
