"""Routing policies: objects that pick one worker for a request and own whatever state they keep.

Every policy has ``name`` and ``select(urls, loads, key) -> Decision``: ``urls`` are the
candidate workers (healthy, not yet tried for this request), in registry order; ``loads`` maps each
to its in-flight request count; ``key`` is the request's :class:`~prefixkv.router.keys.RouteKey`.
``select`` records the choice in the policy's own state, so it is called once per dispatch,
retries included. The router tells a policy what it learns about the workers through two hooks,
``on_worker_health(url, healthy)`` and ``on_worker_stats(url, stats, in_flight)``, and shows
``describe()`` (per-worker extra fields) in ``GET /workers`` and ``/metrics``. The cache-aware
policy, which keeps per-worker trees, lives in :mod:`prefixkv.router.cache_aware`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prefixkv.router.health import WorkerCacheStats
    from prefixkv.router.keys import RouteKey

__all__ = ["POLICY_NAMES", "Decision", "LeastLoadPolicy", "Policy", "RandomPolicy",
           "RoundRobinPolicy", "StatelessPolicy", "check_candidates", "make_policy"]

POLICY_NAMES = ("cache_aware", "consistent_hash", "prefix_hash", "round_robin", "least_load",
                "random", "precise")


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing choice.

    ``reason`` is one of ``cache_hit`` (best match ratio above the threshold), ``balance`` (the
    in-flight loads were imbalanced), ``share`` (a worker got far less than its share of recent
    requests, e.g. it just came back), ``least_load`` (no good match, or the least-load policy),
    ``round_robin``, ``random``, ``hash`` / ``overflow`` (consistent hashing: the key's own
    worker, or a later one on the ring because that one was over its load bound) or
    ``prefix_hash`` (the longest chunk-hash match), or ``exact_hit`` (precise: the longest match
    in the workers' real caches, known from their KV events). ``match_ratio`` is the chosen worker's estimated share of the
    prompt already cached there, ``None`` for policies that keep no trees.
    """

    url: str
    reason: str
    match_ratio: float | None = None


class Policy(Protocol):
    """What the router calls."""

    name: str

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        """Pick one of ``urls`` (non-empty) and record the choice."""
        ...

    def on_worker_health(self, url: str, healthy: bool) -> None:
        """``url`` left (``False``) or re-entered (``True``) the rotation."""
        ...

    def on_worker_stats(self, url: str, stats: WorkerCacheStats, in_flight: int) -> None:
        """A prefixkv worker's real cache figures, read every health interval."""
        ...

    def describe(self) -> dict[str, dict[str, int]]:
        """Per-worker state worth showing (e.g. tree sizes); empty when there is none."""
        ...


def check_candidates(urls: Sequence[str]) -> None:
    """``ValueError`` when there is no candidate."""
    if not urls:
        raise ValueError("urls must name at least one candidate worker")


class StatelessPolicy:
    """Shared by the policies that learn nothing from the workers: the hooks ignore their news."""

    name = "stateless"

    def on_worker_health(self, url: str, healthy: bool) -> None:
        """Nothing to update: the choice depends on the candidates and loads only."""

    def on_worker_stats(self, url: str, stats: WorkerCacheStats, in_flight: int) -> None:
        """Nothing to update."""

    def describe(self) -> dict[str, dict[str, int]]:
        """No per-worker state."""
        return {}


class RoundRobinPolicy(StatelessPolicy):
    """Each candidate in turn (a counter over dispatches, modulo the candidates)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        check_candidates(urls)
        url = urls[self._next % len(urls)]
        self._next += 1
        return Decision(url, "round_robin")


class RandomPolicy(StatelessPolicy):
    """A uniformly random candidate, from the ``rng`` passed in."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        check_candidates(urls)
        return Decision(self._rng.choice(list(urls)), "random")


class LeastLoadPolicy(StatelessPolicy):
    """The candidate with the fewest requests in flight; ties rotate, so idle workers share."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        check_candidates(urls)
        least = min(loads.get(u, 0) for u in urls)
        tied = [u for u in urls if loads.get(u, 0) == least]
        self._turn += 1
        return Decision(tied[self._turn % len(tied)], "least_load")


def make_policy(
    name: str,
    urls: Sequence[str],
    *,
    cache_threshold: float = 0.5,
    balance_abs_threshold: int = 32,
    balance_rel_threshold: float = 1.5,
    balance_window: int = 128,
    max_tree_size: int = 4096,
    eviction_interval: float = 60.0,
    simulate_eviction: bool = False,
    capacity_tokens: int | None = None,
    worker_eviction_policy: str | None = None,
    load_factor: float = 1.25,
    hash_prefix_chunks: int = 16,
    hash_replicas: int = 100,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    kv_events: Sequence[str] = (),
    kv_events_topic: str = "",
    kv_events_rehash: bool = False,
    kv_tier_weights: str | None = None,
) -> Policy:
    """Build a policy by name (``POLICY_NAMES``) for the workers ``urls``.

    Each policy reads its own settings and ignores the rest: ``cache_aware`` the thresholds,
    window, ``max_tree_size`` (key chunks), ``eviction_interval``, ``simulate_eviction``,
    ``capacity_tokens`` and ``worker_eviction_policy``; ``prefix_hash`` ``max_tree_size``;
    ``consistent_hash`` ``load_factor``, ``hash_prefix_chunks`` and ``hash_replicas``;
    ``precise`` (KV events) ``kv_events`` (per worker: ``auto``, ``none`` or endpoints),
    ``kv_events_topic``, ``kv_events_rehash``, ``kv_tier_weights`` (``"pool=1,host=0.8,..."``)
    and everything ``cache_aware`` reads (its fallback).
    """
    if name in ("cache_aware", "precise"):
        from prefixkv.router.cache_aware import CacheAwarePolicy

        aware = CacheAwarePolicy(
            urls, cache_threshold=cache_threshold, balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold, balance_window=balance_window,
            max_tree_size=max_tree_size, eviction_interval=eviction_interval, clock=clock,
            simulate_eviction=simulate_eviction, capacity_tokens=capacity_tokens,
            eviction_policy=worker_eviction_policy,
        )
        if name == "cache_aware":
            return aware
        from prefixkv.router.kv_index import TierWeights
        from prefixkv.router.kv_stream import parse_sources
        from prefixkv.router.precise import PrecisePolicy

        return PrecisePolicy(urls, aware, sources=parse_sources(urls, kv_events, kv_events_topic),
                             cache_threshold=cache_threshold, balance_window=balance_window,
                             rehash=kv_events_rehash, clock=clock,
                             tier_weights=TierWeights.parse(kv_tier_weights))
    if name == "consistent_hash":
        from prefixkv.router.chwbl import ConsistentHashPolicy

        return ConsistentHashPolicy(urls, load_factor=load_factor,
                                    prefix_chunks=hash_prefix_chunks, replicas=hash_replicas)
    if name == "prefix_hash":
        from prefixkv.router.prefix_hash import PrefixHashPolicy

        return PrefixHashPolicy(urls, max_tree_size=max_tree_size, clock=clock)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "random":
        return RandomPolicy(rng)
    raise ValueError(f"policy must be one of {list(POLICY_NAMES)}, got {name!r}")
