"""Routing policies: small objects that pick one worker for a request.

Every policy has ``name`` and ``select(urls, loads, key) -> Decision``: ``urls`` are the
candidate workers (healthy, not yet tried for this request), in registry order; ``loads`` maps each
to its in-flight request count; ``key`` is the request's :class:`~prefixkv.router.tree.RouteKey`.
``select`` records the choice in whatever state the policy keeps (the cache-aware trees), so it is
called once per dispatch, retries included.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prefixkv.router.tree import PrefixTrees, RouteKey

POLICY_NAMES = ("cache_aware", "round_robin", "least_load", "random")


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing choice.

    ``reason`` is one of ``cache_hit`` (best match ratio above the threshold), ``balance`` (the
    loads were imbalanced), ``least_load`` (no good match, or the least-load policy),
    ``round_robin`` or ``random``. ``match_ratio`` is the chosen worker's estimated share of the
    prompt already cached there (0.0 for policies that keep no trees).
    """

    url: str
    reason: str
    match_ratio: float = 0.0


class Policy(Protocol):
    """What the router calls."""

    name: str

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        """Pick one of ``urls`` (non-empty)."""
        ...


def _check(urls: Sequence[str]) -> None:
    if not urls:
        raise ValueError("urls must name at least one candidate worker")


class RoundRobinPolicy:
    """Each candidate in turn (a counter over dispatches, modulo the candidates)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        _check(urls)
        url = urls[self._next % len(urls)]
        self._next += 1
        return Decision(url, "round_robin")


class RandomPolicy:
    """A uniformly random candidate, from the ``rng`` passed in."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        _check(urls)
        return Decision(self._rng.choice(list(urls)), "random")


class LeastLoadPolicy:
    """The candidate with the fewest requests in flight; ties rotate, so idle workers share."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        _check(urls)
        least = min(loads.get(u, 0) for u in urls)
        tied = [u for u in urls if loads.get(u, 0) == least]
        self._turn += 1
        return Decision(tied[self._turn % len(tied)], "least_load")


class CacheAwarePolicy:
    """SGLang's cache-aware policy (seed 003) over per-worker approximate prefix trees.

    1. If the loads are imbalanced (``max - min > balance_abs_threshold`` and
       ``max > min * balance_rel_threshold``), the least-loaded candidate (reason ``balance``).
    2. Else, if the best match ratio exceeds ``cache_threshold``, the candidate with the longest
       match (ties: least load, then smallest tree) (reason ``cache_hit``).
    3. Else the least-loaded candidate, ties to the smallest tree: the worker with most room for
       a new prefix (reason ``least_load``).

    The chosen worker's tree then records the prompt. Owns nothing but a reference to ``trees``.
    """

    name = "cache_aware"

    def __init__(
        self,
        trees: PrefixTrees,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold!r}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold!r}")
        self.trees = trees
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def is_imbalanced(self, loads: Sequence[int]) -> bool:
        """SGLang's test: both the absolute and the relative gap exceed their thresholds."""
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        _check(urls)
        load = {u: loads.get(u, 0) for u in urls}
        matched = self.trees.match(key, urls)
        ratio = {u: (matched[u] / len(key) if len(key) else 0.0) for u in urls}
        if self.is_imbalanced(list(load.values())):
            url = min(urls, key=lambda u: load[u])
            reason = "balance"
        elif max(ratio.values()) > self.cache_threshold:
            url = min(urls, key=lambda u: (-matched[u], load[u], self.trees.size(u)))
            reason = "cache_hit"
        else:
            url = min(urls, key=lambda u: (load[u], self.trees.size(u)))
            reason = "least_load"
        self.trees.insert(url, key)
        return Decision(url, reason, ratio[url])


def make_policy(
    name: str,
    *,
    trees: PrefixTrees | None = None,
    cache_threshold: float = 0.5,
    balance_abs_threshold: int = 32,
    balance_rel_threshold: float = 1.5,
    rng: random.Random | None = None,
) -> Policy:
    """Build a policy by name (``POLICY_NAMES``); ``cache_aware`` needs ``trees``."""
    if name == "cache_aware":
        if trees is None:
            raise ValueError("trees is required for the cache_aware policy")
        return CacheAwarePolicy(
            trees,
            cache_threshold=cache_threshold,
            balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold,
        )
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "random":
        return RandomPolicy(rng)
    raise ValueError(f"policy must be one of {list(POLICY_NAMES)}, got {name!r}")
