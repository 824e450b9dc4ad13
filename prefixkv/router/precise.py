"""The ``precise`` policy: route on the workers' real caches, known from their KV events.

llm-d and NVIDIA Dynamo route this way; SGLang's ``cache_aware`` guesses each worker's cache from
the requests it routed. Here every worker that publishes KV events (``prefixkv serve
--kv-events-config``, or any worker speaking vLLM's event format with the same block hashes)
feeds an exact index (:class:`~prefixkv.router.kv_index.ExactIndex`: block hash -> workers), so
the router knows what each worker evicted, that it restarted, or that an admin reset it.

**Tokens.** Block hashes are over token ids, and the router has no tokenizer. Choice: before
routing, the policy asks one worker's ``POST /tokenize`` (vLLM's and prefixkv's route) for the
prompt's ids: ``{"messages": ...}`` for a chat (the worker applies its chat template exactly as
it will for the request) or ``{"prompt": ...}``; a prompt given as token ids needs no call. It
costs one loopback round trip per request but needs no model files on the router and stays
exact for any model and template. When no candidate publishes events, nothing is asked.

**Choosing** (over the candidates; thresholds as ``cache_aware``'s):

1. **balance**: loads imbalanced (SGLang's test) -> the least loaded.
2. **cache_hit**: the best match ratio over ``cache_threshold`` -> among the workers whose match
   is within ``tie_blocks`` (1) blocks of the longest, the one with fewer in flight (then fewer
   recent dispatches, then the longer match), unless the share rule moves it to a
   starved worker (as ``cache_aware``'s). A publishing worker's ratio is its exact number of
   leading cached blocks times the block size over the prompt's tokens, or, if longer, the
   blocks it shares with a prompt sent to it in the last ``pending_ttl`` seconds and since its
   cache was last cleared (being computed there, not announced yet: without this, concurrent
   sessions sharing a new prefix were spread over every worker before the first one's events
   came). For a worker whose stream lost batches (incomplete index): the larger of that and its
   approximate tree's estimate; for a worker that publishes nothing (or before its first
   batch): the approximate tree's estimate, as ``cache_aware`` computes it. Why the near-tie:
   new sessions under a short shared system prompt match every holder of it, and one holder
   often has one more block (the template tokens after it, shared with an earlier session's
   first words); ranking on that block put every new session on that worker whatever its load
   (10-word turns over 64-block pools: [63, 16, 17, 0] requests per worker, 1.11x
   ``cache_aware``'s computed tokens), where ``cache_aware``'s chunks round it to a tie.
3. otherwise (no worker really holds much of the prompt) the embedded ``cache_aware`` decides
   on its approximate trees: a session whose cache a worker lost (evicted, reset) stays where
   its tree says, usually ``least_load`` for a new prefix. Measured: choosing the least loaded
   worker here instead moved sessions after every reset onto busy workers, whose pools then
   evicted their own sessions (1.13-1.16x cache_aware's computed tokens with resets every 8
   requests); the emptied worker is the one with room.

Without tokens (tokenization failed) or without any publishing candidate, the request is routed
by the embedded :class:`~prefixkv.router.cache_aware.CacheAwarePolicy` unchanged. Every choice is
recorded in that policy's approximate trees, so the fallback always has its history.

**Event streams.** Each worker's endpoint is given (``--kv-events``) or discovered from its
``GET /kv_events``; a worker that comes back into rotation, or whose stats show a restart, is
re-discovered (a restarted worker may publish on another port) and its index forgotten until its
new stream speaks. Streams run as tasks on the router's loop (:mod:`prefixkv.router.kv_stream`);
workers sharing one ``bind:`` address (llm-d's ``kv@<ip>:<port>@<model>`` topics) share one task.

**Tiers.** A worker's exact match counts its leading blocks held in any tier, each weighted by
the tier (``tier_weights``: pool 1.0, host 0.8, disk and remote 0.25, as llm-d weighs a CPU-tier
block against a GPU one), so a worker holding a prompt in its pool beats one that must load it
from disk, and one holding it on disk still beats one that holds nothing.

**Salted prompts.** The prompt's hashes are computed under its ``cache_salt`` / ``extra_key``
(:func:`~prefixkv.router.keys.body_salt`), as the worker hashed them: prefixkv workers publish
a salted request's hashes without its tokens, and the router needs no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import zmq.asyncio

from prefixkv.wire.kv_events import block_hashes
from prefixkv.router.cache_aware import CacheAwarePolicy
from prefixkv.router.keys import RouteKey, body_salt
from prefixkv.router.kv_index import ExactIndex, TierWeights
from prefixkv.router.kv_stream import EventSource, EventStream, SharedEventStream, discover_source
from prefixkv.router.policies import Decision, check_candidates

if TYPE_CHECKING:
    from prefixkv.router.health import WorkerCacheStats

__all__ = ["PrecisePolicy", "TokenRouteKey"]

log = logging.getLogger("prefixkv.router")

_UNLISTED_TTL = 10.0
"""Seconds before a model name no worker listed is looked up in ``/v1/models`` again."""
_MAX_UNLISTED = 4096
"""Unlisted model names remembered at most (the oldest forgotten first)."""


@dataclass(frozen=True, slots=True)
class TokenRouteKey(RouteKey):
    """A route key with the prompt's token ids and the workers' cache namespace."""

    tokens: tuple[int, ...] = ()
    cache_namespace: Hashable = None


class PrecisePolicy:
    """Owns the exact index, the event streams and a :class:`CacheAwarePolicy` (``fallback``).

    ``sources``: per worker, its :class:`EventSource`, ``None`` (publishes nothing), or absent
    (discover it). ``rehash``: the workers' hashes are not prefixkv's (vLLM workers): derive
    them from the events' tokens (:class:`~prefixkv.router.kv_index.ExactIndex`).
    ``tier_weights``: what a block is worth by the tier holding it. Used from the router's event
    loop only.
    """

    name = "precise"

    def __init__(self, urls: Iterable[str], fallback: CacheAwarePolicy, *,
                 sources: Mapping[str, EventSource | None] | None = None,
                 cache_threshold: float = 0.5, balance_window: int = 128,
                 tokenize_timeout: float = 5.0, rehash: bool = False, pending_ttl: float = 5.0,
                 tie_blocks: int = 1, clock: Callable[[], float] = time.monotonic,
                 tier_weights: TierWeights | None = None) -> None:
        self.urls = list(urls)
        self.fallback = fallback
        self.index = ExactIndex(self.urls, rehash=rehash, weights=tier_weights)
        self.sources = dict(sources or {})
        self.cache_threshold = cache_threshold
        self.tokenize_timeout = tokenize_timeout
        self._fair_share = balance_window / len(self.urls) if self.urls else 0.0
        self._dispatches = 0
        self._last_move = -balance_window
        self._client: httpx.AsyncClient | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._prompt_tokens: dict[str, int] = {}
        self.pending_ttl = pending_ttl
        self.tie_blocks = tie_blocks
        self._clock = clock
        # prompts sent to each worker lately: (expiry, index epoch, block hashes), oldest first;
        # an entry from before the worker's cache was last cleared no longer counts
        self._pending: dict[str, deque[tuple[float, int, list[int]]]] = {}
        self._hashes: dict[int, list[int]] = {}  # block size -> this request's hashes
        self._models: dict[str, bool] = {}  # model names the workers list -> is a LoRA adapter
        self._unlisted: OrderedDict[str, float] = OrderedDict()  # name -> asked again after

    # ---------------------------------------------------------------- streams
    async def start(self, client: httpx.AsyncClient) -> None:
        """Open every worker's stream (discovering endpoints as needed)."""
        self._client = client
        self._ctx = zmq.asyncio.Context()
        shared: dict[str, dict[str, EventStream]] = {}
        for url in self.urls:
            source = self.sources.get(url)
            if source is not None and source.shared:
                shared.setdefault(source.endpoint, {})[url] = EventStream(
                    url, source, self.index, self._ctx)
            else:
                self._follow(url)
        loop = asyncio.get_running_loop()
        for endpoint, streams in shared.items():
            source = next(iter(streams.values())).source
            self._tasks[endpoint] = loop.create_task(self._shared(source, streams))

    async def _shared(self, source: EventSource, streams: dict[str, EventStream]) -> None:
        if self._ctx is None:
            return
        try:
            await SharedEventStream(source, streams, self._ctx).run()
        except zmq.ZMQError as exc:
            log.warning("KV events on %s stopped: %s", source.endpoint, exc)

    async def stop(self) -> None:
        """Cancel the streams and close the ZMQ context."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _follow(self, url: str) -> None:
        old = self._tasks.pop(url, None)
        if old is not None:
            old.cancel()
        if self._ctx is not None:
            self._tasks[url] = asyncio.get_running_loop().create_task(self._stream(url))

    async def _stream(self, url: str) -> None:
        explicit = url in self.sources
        source = self.sources.get(url)
        if not explicit and self._client is not None:
            source = await discover_source(self._client, url)
        if source is None or self._ctx is None:
            return  # publishes nothing: the approximate tree routes for it
        try:
            await EventStream(url, source, self.index, self._ctx).run()
        except zmq.ZMQError as exc:
            log.warning("KV events from %s (%s) stopped: %s", url, source.endpoint, exc)

    def _restarted(self, url: str) -> None:
        self.index.reset(url, complete=False, live=False)
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to restart
            self._follow(url)

    # ---------------------------------------------------------------- tokens
    async def annotate(self, client: httpx.AsyncClient, urls: Sequence[str], path: str,
                       body: Mapping[str, Any], key: RouteKey,
                       headers: Mapping[str, str] | None = None) -> RouteKey:
        """``key`` with the prompt's token ids (see the module docstring), or ``key`` itself
        when no candidate publishes events or the ids cannot be had."""
        live = [u for u in urls if self.index.workers[u].live]
        if not live or path.endswith(("/responses", "/messages")):  # (no ids for those inputs here)
            return key
        auth = {"authorization": headers["authorization"]} if headers and \
            "authorization" in headers else None
        if await self._is_adapter(client, live[0], body.get("model"), auth):
            # its blocks are keyed by the adapter's weights, which the index cannot hash (their
            # events are not indexed): never score it on the base model's blocks of its prompt;
            # the approximate trees, keyed by model name, keep its requests together
            return key
        salt = body_salt(body)
        ns = (salt, None) if salt is not None else None
        ids: Any = None
        payload: dict[str, Any] = {}
        if path.endswith("/chat/completions"):
            payload["messages"] = body.get("messages")
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
                if name in body:
                    payload[name] = body[name]
        else:
            prompt = body.get("prompt")
            if path == "/generate":  # SGLang's: input_ids or text
                prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, list):
                ids = prompt
            else:
                payload["prompt"] = prompt
        if ids is None:
            if isinstance(body.get("model"), str):
                payload["model"] = body["model"]
            try:
                resp = await client.post(f"{live[0]}/tokenize", json=payload, headers=auth,
                                         timeout=self.tokenize_timeout)
                ids = resp.json().get("tokens") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                return key
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            return key
        return TokenRouteKey(key.namespace, key.chunks, key.size, key.unit, tuple(ids), ns)

    async def _is_adapter(self, client: httpx.AsyncClient, url: str, model: object,
                          auth: Mapping[str, str] | None) -> bool:
        """Whether ``model`` is a LoRA adapter (``/v1/models`` lists it with a ``parent``, as
        vLLM and prefixkv do); a name not seen yet is looked up once on ``url``."""
        if not isinstance(model, str) or model in self._models:
            return isinstance(model, str) and self._models[model]
        now = self._clock()
        if self._unlisted.get(model, now) > now:  # asked lately and no worker listed it
            return False
        try:
            resp = await client.get(f"{url}/v1/models", headers=auth, timeout=self.tokenize_timeout)
            listed = resp.json().get("data", []) if resp.status_code == 200 else []
            for entry in listed:
                if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                    self._models[entry["id"]] = bool(entry.get("parent"))
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        if model not in self._models:  # a name no worker serves: not asked again for a while,
            # so clients sending made-up names cannot make every request cost a lookup
            self._unlisted[model] = now + _UNLISTED_TTL
            self._unlisted.move_to_end(model)
            while len(self._unlisted) > _MAX_UNLISTED:
                self._unlisted.popitem(last=False)
        return self._models.get(model, False)

    # ---------------------------------------------------------------- choosing
    def exact_matches(self, urls: Sequence[str], key: RouteKey) -> dict[str, float]:
        """Per live candidate: its leading cached tokens of the prompt, weighted by the tiers
        holding them (empty without tokens)."""
        if not isinstance(key, TokenRouteKey) or not key.tokens:
            return {}
        by_size: dict[int, list[str]] = {}
        for u in urls:
            w = self.index.workers[u]
            if w.live and w.block_size:
                by_size.setdefault(w.block_size, []).append(u)
        out: dict[str, float] = {}
        now = self._clock()
        for bs, group in by_size.items():
            try:
                hashes = block_hashes(key.tokens, bs, key.cache_namespace)
            except ValueError:
                continue
            self._hashes[bs] = hashes
            for u, n in self.index.match(hashes, group).items():
                out[u] = max(n, self._pending_match(u, hashes, now)) * bs
        return out

    def _pending_match(self, url: str, hashes: list[int], now: float) -> int:
        """Leading blocks of ``hashes`` shared with a prompt sent to ``url`` in the last
        ``pending_ttl`` seconds (being computed there: its events have not come yet)."""
        pending = self._pending.get(url)
        epoch = self.index.workers[url].epoch
        while pending and (pending[0][0] <= now or pending[0][1] != epoch):
            pending.popleft()
        best = 0
        for _, _, sent in pending or ():
            n = 0
            for a, b in zip(sent, hashes):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        check_candidates(urls)
        self._hashes.clear()
        exact = self.exact_matches(urls, key)
        if not exact:
            self._dispatches += 1
            return self.fallback.select(urls, loads, key)
        fb = self.fallback
        fb.maybe_trim()  # the embedded policy's own periodic trim
        n = len(key.tokens) if isinstance(key, TokenRouteKey) else 1
        ratio: dict[str, float] = {}
        for u in urls:
            approx = key.ratio(fb.trees[u].match(key))
            if u not in exact:
                ratio[u] = approx
            else:
                r = exact[u] / n
                ratio[u] = r if self.index.workers[u].complete else max(r, approx)
        load = {u: loads.get(u, 0) for u in urls}
        recent = {u: fb.recent[u] for u in urls}
        if fb.is_imbalanced(list(load.values())):
            url, reason = min(urls, key=lambda u: (load[u], recent[u])), "balance"
            fb.record(url, key)  # keeps the fallback's trees and recent window current
        elif (best := max(ratio.values())) > self.cache_threshold:
            # matches within a block of the best are ties (the load decides among them)
            margin = self.tie_blocks * self._block_size(exact) / n
            url = min((u for u in urls if ratio[u] >= best - margin),
                      key=lambda u: (load[u], recent[u], -ratio[u]))
            reason = "exact_hit" if url in exact else "cache_hit"
            low = min(urls, key=lambda u: (recent[u], load[u]))
            if (self._dispatches - self._last_move >= self._fair_share
                    and fb.share_imbalanced(recent[url], recent[low])):
                url, reason = low, "share"
                self._last_move = self._dispatches
            fb.record(url, key)
        else:  # no worker really holds much of it: cache_aware's guess keeps sessions in place
            decision = fb.select(urls, loads, key)
            url, reason = decision.url, decision.reason  # (it recorded the choice)
        self._pend(url)
        self._dispatches += 1
        return Decision(url, reason, ratio[url])

    def _block_size(self, exact: Mapping[str, float]) -> int:
        """The largest block size among the publishing candidates (a near-tie's unit)."""
        return max((self.index.workers[u].block_size or 0 for u in exact), default=0)

    def _pend(self, url: str) -> None:
        """Remember the prompt just sent to ``url`` as pending there."""
        bs = self.index.workers[url].block_size
        if bs in self._hashes and self.pending_ttl > 0:
            self._pending.setdefault(url, deque()).append(
                (self._clock() + self.pending_ttl, self.index.workers[url].epoch,
                 self._hashes[bs]))

    # ---------------------------------------------------------------- worker news
    def on_worker_health(self, url: str, healthy: bool) -> None:
        """Back in rotation: re-discover its stream (it may have restarted elsewhere)."""
        self.fallback.on_worker_health(url, healthy)
        if healthy and url not in self.sources:
            self._restarted(url)

    def on_dispatch_failed(self, url: str) -> None:
        """The fallback's recent window forgets the failed dispatch."""
        self.fallback.on_dispatch_failed(url)

    def on_worker_stats(self, url: str, stats: WorkerCacheStats, in_flight: int) -> None:
        """The fallback's alignment; a prompt-token counter that went back means a restart."""
        self.fallback.on_worker_stats(url, stats, in_flight)
        last = self._prompt_tokens.get(url)
        self._prompt_tokens[url] = stats.prompt_tokens
        if last is not None and stats.prompt_tokens < last and url not in self.sources:
            self._restarted(url)

    def describe(self) -> dict[str, dict[str, int]]:
        """The fallback's per-worker fields plus the exact index's."""
        base = self.fallback.describe()
        return {u: {**base.get(u, {}), **self.index.describe(u)} for u in self.urls}

