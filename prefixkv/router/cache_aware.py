"""The cache-aware policy: SGLang's (seed 003) over per-worker approximate trees it owns.

For each request, over the candidate workers (healthy, not yet tried):

1. **balance**: if the in-flight loads are imbalanced (``max - min > balance_abs_threshold`` and
   ``max > min * balance_rel_threshold``, SGLang's test), the least-loaded candidate.
2. **cache_hit**: if the best match ratio exceeds ``cache_threshold``, the candidate with the
   longest match (ties: least in flight, fewest recent dispatches, smallest tree), unless
   **share**: the candidate with the fewest dispatches among the last ``balance_window`` got
   less than a quarter of its fair share (``window / workers``) while that worker got more than
   its fair share; then the request (its session) moves to the former. At most one move per fair
   share of dispatches, so each move shows in the counts before the next (no see-saw). This is
   what gives a worker that comes back (killed and restarted, or hung and resumed) its share
   again when every prompt matches elsewhere (a long shared system prompt); a moved session
   pays one prefill, then follows its new tree.
3. **least_load**: else (a new prefix) the candidate with the fewest requests in flight, then
   the fewest recent dispatches, then the smallest tree. Sessions are long-lived: with ties
   broken by tree size, a worker whose sessions happened to finish first collected the next
   ones (max/min requests per worker up to 1.8); the recent count tracks the work a worker was
   given.

The chosen worker's tree then records the prompt. Trees are trimmed to their bound every
``eviction_interval`` seconds (checked on each ``select``; at once after each insert when 0).

Worker news (the hooks). A worker leaving the rotation keeps its tree: a dropped connection or a
slow probe does not empty what it has cached, and a worker that was really restarted is caught by
its stats. ``on_worker_stats`` (prefixkv workers) bounds a tree by the worker's real KV capacity,
converted to chunks at the rate measured from the chunks routed there and the prompt tokens it
reports (once 1,000 were seen), and empties the tree when the worker restarted (its prompt-token
counter went below the last value seen; the restarted worker's dispatches then leave the recent
window too, so it takes new prefixes at once; a dispatch that failed leaves it as well) or reports an empty cache with nothing in flight (an admin reset, a restart,
or prefix caching off).

**Simulated eviction** (``simulate_eviction=True``; the Gateway API Inference Extension EPP's
prefix plugin, seed 003): each tree is bounded by its worker's real KV capacity, read from the
worker's stats or given as ``capacity_tokens`` (which wins; vLLM and SGLang workers have no
stats), and trimmed after every insert instead of every ``eviction_interval`` with up to twice
the bound in between (the request just routed keeps its chunks: its blocks are locked on the
worker while it runs), in the order of the worker's own eviction policy: ``eviction_policy``
(any :data:`prefixkv.cache.POLICIES` name, for all workers; wins) or the policy each worker's
stats name (``cache.policy``), else LRU (prefixkv's default). The tree's policy comes from
:func:`prefixkv.cache.make_policy`; learning a different one from a worker's stats rebuilds that
worker's tree empty (the cache fixes its policy when built), which happens at the first stats
read, one health interval after start. The tree thus replays the worker's eviction and forgets a
prefix when the worker must have evicted it, so the router stops sending a session back to a
worker that no longer holds its prefix. Not exact: the router's chunks are not the worker's
blocks, and a match on a worker that does not get the request still counts as a use in its
tree (the cache has no read-only match). Tokens are converted to chunks at the
rate measured from the worker's prompt-token counter, or, until 1,000 tokens were measured (or
without stats), estimated at ``BYTES_PER_TOKEN`` bytes per token of the routed text prompts.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from prefixkv.cache import make_policy
from prefixkv.router.policies import Decision, check_candidates
from prefixkv.router.tree import ApproxTree

if TYPE_CHECKING:
    from prefixkv.router.health import WorkerCacheStats
    from prefixkv.router.replicas import PeerLoads
    from prefixkv.router.keys import RouteKey

__all__ = ["BYTES_PER_TOKEN", "CacheAwarePolicy"]

BYTES_PER_TOKEN = 4  # typical for BPE tokenizers on English text; only until a rate is measured


class CacheAwarePolicy:
    """Owns one :class:`ApproxTree` per worker, the recent-dispatch window and the stats baselines.

    ``max_tree_size`` is in key chunks. Used from the router's event loop only.
    """

    name = "cache_aware"

    def __init__(
        self,
        urls: Iterable[str],
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        balance_window: int = 128,
        max_tree_size: int = 4096,
        eviction_interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        simulate_eviction: bool = False,
        capacity_tokens: int | None = None,
        eviction_policy: str | None = None,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold!r}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold!r}")
        if balance_window < 0:
            raise ValueError(f"balance_window must be >= 0, got {balance_window!r}")
        if eviction_interval < 0:
            raise ValueError(f"eviction_interval must be >= 0, got {eviction_interval!r}")
        if capacity_tokens is not None and (not isinstance(capacity_tokens, int)
                                            or isinstance(capacity_tokens, bool)
                                            or capacity_tokens <= 0):
            raise ValueError(f"capacity_tokens must be a positive int, got {capacity_tokens!r}")
        if eviction_policy is not None:
            eviction_policy = make_policy(eviction_policy).name  # ValueError names the field
        self.simulate_eviction = simulate_eviction
        self.eviction_policy = eviction_policy
        self.capacity_tokens = capacity_tokens
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.eviction_interval = eviction_interval
        self._clock = clock
        self._last_trim = clock()
        tree_policy = (eviction_policy or "lru") if simulate_eviction else "lru"
        self.trees = {url: ApproxTree(max_tree_size, eviction_policy=tree_policy, clock=clock)
                      for url in urls}
        self._window: deque[str] = deque(maxlen=balance_window)
        self.recent: Counter[str] = Counter()
        self._fair_share = balance_window / len(self.trees) if self.trees else 0.0
        self._dispatches = 0
        self._last_move = -balance_window
        # chunks routed to each worker, and (chunks, worker prompt tokens) at its first stats
        self._routed = dict.fromkeys(self.trees, 0)
        self._baseline: dict[str, tuple[int, int]] = {}
        self._last_tokens: dict[str, int] = {}  # each worker's prompt-token counter, last seen
        # simulated eviction: estimated prompt tokens routed, the capacity and measured rate
        self._routed_tokens = dict.fromkeys(self.trees, 0.0)
        self._capacity: dict[str, int] = {}
        self._rate: dict[str, float] = {}
        self.listener: Callable[[str, RouteKey], None] | None = None
        self.peer_loads: PeerLoads | None = None  # router replicas: their in-flight requests
        self.replica_index = 0  # router replicas: this one's position (ties start there)
        self._order = {url: i for i, url in enumerate(self.trees)}

    # ------------------------------------------------------------------ choosing
    def is_imbalanced(self, loads: Sequence[int]) -> bool:
        """SGLang's test: both the absolute and the relative gap exceed their thresholds."""
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def share_imbalanced(self, hi: int, lo: int) -> bool:
        """Whether a worker with ``hi`` recent dispatches should hand a session to one with
        ``lo``: ``lo`` below a quarter of a fair share, ``hi`` above a fair share."""
        if not self._window.maxlen:
            return False
        return lo < self._fair_share / 4 and hi > self._fair_share

    def select(self, urls: Sequence[str], loads: Mapping[str, int], key: RouteKey) -> Decision:
        check_candidates(urls)
        self.maybe_trim()
        load = ({u: loads.get(u, 0) for u in urls} if self.peer_loads is None
                else self.peer_loads.add(loads, urls))
        recent = {u: self.recent[u] for u in urls}
        matched = {u: self.trees[u].match(key) for u in urls}
        if self.is_imbalanced(list(load.values())):
            url = min(urls, key=lambda u: (load[u], recent[u]))
            reason = "balance"
        elif key.ratio(max(matched.values())) > self.cache_threshold:
            url = min(urls, key=lambda u: (-matched[u], load[u], recent[u], self.trees[u].size))
            reason = "cache_hit"
            low = min(urls, key=lambda u: (recent[u], load[u]))
            if (self._dispatches - self._last_move >= self._fair_share
                    and self.share_imbalanced(recent[url], recent[low])):
                url, reason = low, "share"
                self._last_move = self._dispatches
        else:
            # replicas: requests arriving at several routers at once see the same loads; each
            # replica breaks the ties from its own worker (``replica_index``), so they spread
            n = len(self._order)
            url = min(urls, key=lambda u: (load[u], recent[u], self.trees[u].size,
                                           (self._order[u] - self.replica_index) % n))
            reason = "least_load"
        self.record(url, key)
        return Decision(url, reason, key.ratio(matched[url]))

    def record(self, url: str, key: RouteKey) -> None:
        """``key`` was sent to ``url``: its tree, load and recent window learn it (also called
        by :class:`~prefixkv.router.precise.PrecisePolicy`, which embeds this policy); then the
        ``listener`` hears of it (router replicas: :mod:`prefixkv.router.replicas`)."""
        self._learn(url, key)
        self._dispatches += 1
        self._count(url)
        if self.listener is not None:
            self.listener(url, key)

    def learn(self, url: str, key: RouteKey) -> bool:
        """Another router replica sent ``key`` to ``url``: its tree and the recent-dispatch
        window learn it (so new sessions spread by the fleet's dispatches, not this replica's
        share of them); the in-flight loads stay this router's own. ``False`` for a worker it
        does not know."""
        if url not in self.trees:
            return False
        self._learn(url, key)
        self._count(url)
        return True

    def _count(self, url: str) -> None:
        if self._window.maxlen:
            if len(self._window) == self._window.maxlen:
                self.recent[self._window[0]] -= 1
            self._window.append(url)
            self.recent[url] += 1

    def _learn(self, url: str, key: RouteKey) -> None:
        tree = self.trees[url]
        self._routed[url] += len(key)
        if self.simulate_eviction:
            ns = key.namespace
            text = isinstance(ns, tuple) and bool(ns) and ns[0] == "text"
            self._routed_tokens[url] += key.size / BYTES_PER_TOKEN if text else key.size
            self._set_bound(url)
            tree.insert(key, trim=True)  # the request's own chunks stay: running there
        else:
            tree.insert(key)
            if self.eviction_interval == 0:
                tree.trim()

    def on_dispatch_failed(self, url: str) -> None:
        """A dispatch to ``url`` failed (refused, dropped, or a 5xx retried elsewhere): it leaves
        the recent window, so a worker that was down does not come back looking as if it had
        been given more than its share (its failed attempts had counted as work)."""
        for i in range(len(self._window) - 1, -1, -1):  # its newest dispatch
            if self._window[i] == url:
                del self._window[i]
                self.recent[url] -= 1
                return

    def maybe_trim(self) -> None:
        """Trim every tree when ``eviction_interval`` seconds have passed since the last trim."""
        now = self._clock()
        if self.eviction_interval > 0 and now - self._last_trim >= self.eviction_interval:
            self._last_trim = now
            self.trim()

    def trim(self) -> int:
        """Trim every tree to its bound; returns the chunks evicted."""
        return sum(tree.trim() for tree in self.trees.values())

    # ---------------------------------------------------------------- worker news
    def on_worker_health(self, url: str, healthy: bool) -> None:
        """Keep the tree either way: see the module docstring (stats catch a real restart)."""

    def on_worker_stats(self, url: str, stats: WorkerCacheStats, in_flight: int) -> None:
        """Align ``url``'s tree with its prefixkv worker's real cache (module docstring)."""
        tree = self.trees[url]
        if self.simulate_eviction and self.eviction_policy is None and stats.eviction_policy:
            try:
                tree.set_eviction_policy(stats.eviction_policy)
            except ValueError:
                pass  # a policy this router does not know: keep the current order
        routed = self._routed[url]
        base = self._baseline.get(url)
        last = self._last_tokens.get(url)
        self._last_tokens[url] = stats.prompt_tokens
        if last is not None and stats.prompt_tokens < last:  # the worker restarted (its counter went back)
            tree.reset()
            base = None
            # and lost the sessions it was given: its old dispatches no longer make it look busy
            self._window = deque((u for u in self._window if u != url), maxlen=self._window.maxlen)
            self.recent[url] = 0
        if base is None:
            self._baseline[url] = base = (routed, stats.prompt_tokens)
        tokens = stats.prompt_tokens - base[1]
        self._capacity[url] = stats.capacity_tokens
        if tokens >= 1000 and routed > base[0]:
            self._rate[url] = (routed - base[0]) / tokens
            self._set_bound(url)
            if self.eviction_interval == 0 or self.simulate_eviction:
                tree.trim()
        if stats.cached_blocks == 0 and in_flight == 0:
            tree.reset()

    def _set_bound(self, url: str) -> None:
        """Bound ``url``'s tree by its KV capacity in chunks, once a capacity and rate are known.

        Without simulated eviction only the measured rate and the worker's capacity are used.
        """
        capacity = self._capacity.get(url)
        rate = self._rate.get(url)
        if self.simulate_eviction:
            capacity = self.capacity_tokens or capacity
            if rate is None and self._routed_tokens[url] > 0:
                rate = self._routed[url] / self._routed_tokens[url]
        if capacity is None or rate is None:
            return
        self.trees[url].max_size = max(1, min(int(capacity * rate), self.max_tree_size))

    def describe(self) -> dict[str, dict[str, int]]:
        """Per worker: ``tree_size`` and ``tree_bound`` (chunks), ``recent`` dispatches."""
        return {url: {"tree_size": t.size, "tree_bound": t.max_size, "recent": self.recent[url]}
                for url, t in self.trees.items()}
