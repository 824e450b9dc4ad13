"""Longest prefix-hash match: the vLLM production stack's prefix-aware router (seed 003).

vLLM's router keeps a ``HashTrie`` of the chunk hashes of past prompts, each node listing the
endpoints that were sent a prompt through it, and sends a request to an endpoint with the
longest match (its RFC compared this with SimHash consistent hashing and found the trie better).
Here each worker's trie is an :class:`~prefixkv.router.tree.ApproxTree` (a ``RadixPrefixCache``
over the route key's chunk hashes, :mod:`prefixkv.router.keys`), the same structure the
cache-aware policy uses, bounded by ``max_tree_size`` chunks with LRU trimming.

vLLM hashes prompts in chunks of 128 characters, so a match shorter than 128 bytes does not
exist there; route keys start with 16-byte chunks (finer, for ``cache_aware``'s ratios), so a
match only counts from ``min_match_bytes`` (128) on. Without that a short shared system prompt,
which vLLM cannot see, would send every session to the first worker that saw it.

For each request: the candidate with the longest match wins (reason ``prefix_hash``), ties to the
fewest in flight; when no candidate matches even one chunk, the least loaded candidate (reason
``least_load``, ties rotate). The chosen worker's trie then records the prompt. Unlike
``cache_aware`` there is no match threshold and no load test: any match, however short, decides,
so requests sharing only a system prompt pile onto one worker until it is dropped from rotation;
that is the trade-off for the simplest rule that follows every shared prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from prefixkv.router.keys import chunk_offset
from prefixkv.router.policies import Decision, check_candidates
from prefixkv.router.tree import ApproxTree

if TYPE_CHECKING:
    from prefixkv.router.health import WorkerCacheStats
    from prefixkv.router.keys import RouteKey

__all__ = ["PrefixHashPolicy"]


class PrefixHashPolicy:
    """One chunk-hash trie per worker; longest match, else least load (module docstring).

    ``max_tree_size`` is each trie's bound in key chunks; tries are trimmed after every insert.
    Used from the router's event loop only.
    """

    name = "prefix_hash"

    def __init__(self, urls: Iterable[str], *, max_tree_size: int = 4096,
                 min_match_bytes: int = 128,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(min_match_bytes, int) or min_match_bytes < 0:
            raise ValueError(f"min_match_bytes must be an int >= 0, got {min_match_bytes!r}")
        self.min_match_bytes = min_match_bytes
        self.trees = {url: ApproxTree(max_tree_size, clock=clock) for url in urls}
        self._turn = 0

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        check_candidates(urls)
        matched = {u: self._counted(key, self.trees[u].match(key)) if u in self.trees else 0
                   for u in urls}
        best = max(matched.values())
        if best > 0:
            url = min((u for u in urls if matched[u] == best), key=lambda u: loads.get(u, 0))
            reason = "prefix_hash"
        else:
            least = min(loads.get(u, 0) for u in urls)
            tied = [u for u in urls if loads.get(u, 0) == least]
            self._turn += 1
            url, reason = tied[self._turn % len(tied)], "least_load"
        tree = self.trees.get(url)
        if tree is not None:
            tree.insert(key)
            tree.trim()
        return Decision(url, reason, key.ratio(matched[url]))

    def _counted(self, key: RouteKey, matched: int) -> int:
        """``matched``, or 0 when it covers fewer than ``min_match_bytes`` (ids: 4 bytes each)."""
        ns = key.namespace
        per_unit = 1 if isinstance(ns, tuple) and ns and ns[0] == "text" else 4
        return matched if chunk_offset(matched, key.unit) * per_unit >= self.min_match_bytes else 0

    def on_worker_health(self, url: str, healthy: bool) -> None:
        """Keep the trie either way (a dropped probe does not empty the worker's cache)."""

    def on_worker_stats(self, url: str, stats: WorkerCacheStats, in_flight: int) -> None:
        """Forget ``url``'s trie when the worker reports an empty cache with nothing in flight."""
        if stats.cached_blocks == 0 and in_flight == 0 and url in self.trees:
            self.trees[url].reset()

    def describe(self) -> dict[str, dict[str, int]]:
        """Per worker: ``tree_size`` and ``tree_bound`` in chunks."""
        return {url: {"tree_size": t.size, "tree_bound": t.max_size}
                for url, t in self.trees.items()}
