"""Residency metrics: how long KV blocks live in each tier, and hit rates per tenant and key.

vLLM's sampled block metrics (``--kv-cache-metrics``, ``--kv-cache-metrics-sample``), per
tier (``pool``, ``host``, ``disk``; the remote tier's server evicts on its own, unseen):

==========================  ======================================================================
``lifetime``                stored to evicted (``vllm:kv_block_lifetime_seconds``)
``idle_before_evict``       last stored or hit to evicted (``vllm:kv_block_idle_before_evict_seconds``)
``reuse_gap``               between consecutive uses of a block (``vllm:kv_block_reuse_gap_seconds``)
==========================  ======================================================================

A block is sampled when it is stored (one in ``1 / rate``, drawn from a seeded generator) and
followed until it is evicted; each tier keeps cumulative :class:`Histogram` s the server turns
into Prometheus histograms. Hit rates (reused over queried prompt tokens, and requests with any
reuse) are kept per tenant (the request's namespace) and per ``cache_key`` (OpenAI's
``prompt_cache_key``, a session id) over the last :data:`HIT_WINDOW_S` seconds.

The clock is injected (``time.monotonic`` by default), so tests never sleep. Thread safe (the
disk tier's writer thread reports its blocks).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixkv.engine.sequence import Sequence

BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
           7200.0, 21600.0, 86400.0)
"""Histogram bucket bounds in seconds (a last, unbounded bucket follows)."""
HIT_WINDOW_S = 300.0
"""Hit rates cover the requests admitted in the last this many seconds."""
MAX_SAMPLED = 100_000
"""Most blocks followed at once per tier (more are not sampled until some leave)."""
MAX_KEYS = 10_000
"""Most tenants and cache keys whose windows are kept (the least recently seen go first)."""


@dataclass(slots=True)
class Histogram:
    """Observations per bucket (``counts[i]``: those in ``(buckets[i-1], buckets[i]]``; the
    last: above every bound), their sum and count, since the start; :meth:`cumulative` gives
    a Prometheus histogram's buckets."""

    buckets: tuple[float, ...] = BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        """Count one observation."""
        i = next((j for j, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(upper bound, observations <= it)`` pairs, ``"+Inf"`` last (Prometheus's form)."""
        out, total = [], 0
        for bound, n in zip((*(f"{b:g}" for b in self.buckets), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out

    def copy(self) -> Histogram:
        """A snapshot."""
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


@dataclass(frozen=True, slots=True)
class ResidencyStats:
    """One tier's sampled residency histograms (seconds) and how many blocks it follows now."""

    tier: str
    lifetime: Histogram
    idle_before_evict: Histogram
    reuse_gap: Histogram
    sampled: int


class ResidencySampler:
    """Follows a sample of one tier's blocks (keys: pool block ids or tier keys)."""

    def __init__(self, tier: str, rate: float, clock: Callable[[], float] = time.monotonic,
                 seed: int = 0) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {rate!r}")
        self.tier = tier
        self._rate = rate
        self._clock = clock
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._blocks: dict[Hashable, tuple[float, float]] = {}  # key -> (stored, last use)
        self._lifetime = Histogram()
        self._idle = Histogram()
        self._gap = Histogram()

    def stored(self, keys: Iterable[Hashable]) -> None:
        """``keys`` entered the tier (a key stored again starts a new life)."""
        now = self._clock()
        with self._lock:
            for k in keys:
                self._blocks.pop(k, None)
                if self._rng.random() < self._rate and len(self._blocks) < MAX_SAMPLED:
                    self._blocks[k] = (now, now)

    def hit(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were read (a prefix hit)."""
        now = self._clock()
        with self._lock:
            for k in keys:
                got = self._blocks.get(k)
                if got is not None:
                    self._gap.observe(now - got[1])
                    self._blocks[k] = (got[0], now)

    def evicted(self, keys: Iterable[Hashable]) -> None:
        """``keys`` left the tier by eviction."""
        now = self._clock()
        with self._lock:
            for k in keys:
                got = self._blocks.pop(k, None)
                if got is not None:
                    self._lifetime.observe(now - got[0])
                    self._idle.observe(now - got[1])

    def forget(self, keys: Iterable[Hashable]) -> None:
        """``keys`` left the tier otherwise (a reset): not an eviction."""
        with self._lock:
            for k in keys:
                self._blocks.pop(k, None)

    def snapshot(self) -> ResidencyStats:
        """The histograms so far."""
        with self._lock:
            return ResidencyStats(self.tier, self._lifetime.copy(), self._idle.copy(),
                                  self._gap.copy(), len(self._blocks))


@dataclass(frozen=True, slots=True)
class HitRate:
    """Requests admitted in the window for one tenant or cache key: how many, how many reused
    any cached prefix, and queried / reused prompt tokens (pool and lower tiers)."""

    requests: int
    hits: int
    queried_tokens: int
    hit_tokens: int

    @property
    def token_hit_rate(self) -> float:
        """Reused over queried tokens (0 without queries)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True, slots=True)
class HitRates:
    """Hit rates over the last ``window_s`` seconds, per tenant and per cache key."""

    window_s: float
    by_tenant: dict[Hashable | None, HitRate]
    by_key: dict[str, HitRate]


class HitWindow:
    """Requests' reuse per tenant and per cache key over a sliding window."""

    def __init__(self, window_s: float = HIT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, Hashable], deque[tuple[float, int, int]]] = {}

    def record(self, tenant: Hashable | None, key: str | None, queried: int, hit: int) -> None:
        """One admitted request of ``tenant`` (and ``key``, if any): ``hit`` of its ``queried``
        prompt tokens were reused."""
        now = self._clock()
        with self._lock:
            for name in (("tenant", tenant), ("key", key)) if key is not None else (("tenant", tenant),):
                rows = self._rows.pop(name, None) or deque()
                rows.append((now, queried, hit))
                self._rows[name] = rows  # (most recently seen last)
            while len(self._rows) > MAX_KEYS:
                del self._rows[next(iter(self._rows))]

    def snapshot(self) -> HitRates:
        """The rates over the window ending now (older requests are dropped)."""
        start = self._clock() - self.window_s
        tenants: dict[Hashable | None, HitRate] = {}
        keys: dict[str, HitRate] = {}
        with self._lock:
            for (kind, name), rows in list(self._rows.items()):
                while rows and rows[0][0] < start:
                    rows.popleft()
                if not rows:
                    del self._rows[(kind, name)]
                    continue
                rate = HitRate(len(rows), sum(1 for r in rows if r[2]),
                               sum(r[1] for r in rows), sum(r[2] for r in rows))
                if kind == "tenant":
                    tenants[name] = rate
                else:
                    keys[str(name)] = rate
        return HitRates(self.window_s, tenants, keys)


class CacheObserver:
    """What the KV manager reports to: the pool's residency sampler (``None`` unless
    ``kv_cache_metrics``), the lower tiers' (made on demand by :meth:`tier`), and hit rates."""

    def __init__(self, rate: float | None = None, clock: Callable[[], float] = time.monotonic,
                 window_s: float = HIT_WINDOW_S) -> None:
        self._rate = rate
        self._clock = clock
        self.pool = None if rate is None else ResidencySampler("pool", rate, clock)
        self.tiers: dict[str, ResidencySampler] = {}
        self.hits = HitWindow(window_s, clock)

    def admitted(self, seq: Sequence, matched: list[int], queried: int, reused: int) -> None:
        """A sequence was admitted: ``matched`` pool blocks hit, ``reused`` of its ``queried``
        readable prompt tokens came from the pool or a lower tier (one record per request:
        its first sample's)."""
        if seq.index == 0:
            req = seq.request
            self.hits.record(req.namespace, req.params.cache_key, queried, reused)
        if self.pool is not None and matched:
            self.pool.hit(matched)

    def stored(self, ids: Iterable[int]) -> None:
        """Pool blocks entered the prefix index."""
        if self.pool is not None:
            self.pool.stored(ids)

    def evicted(self, ids: Iterable[int]) -> None:
        """Pool blocks were evicted from the prefix index."""
        if self.pool is not None:
            self.pool.evicted(ids)

    def tier(self, name: str) -> ResidencySampler | None:
        """The sampler of lower tier ``name`` (``None`` with metrics off)."""
        if self._rate is None:
            return None
        return self.tiers.setdefault(name, ResidencySampler(name, self._rate, self._clock))

    def residency(self) -> list[ResidencyStats]:
        """Per tier, the pool first (empty with metrics off)."""
        samplers = ([] if self.pool is None else [self.pool]) + list(self.tiers.values())
        return [s.snapshot() for s in samplers]


def make_observer(metrics: bool, rate: float, clock: Callable[[], float] = time.monotonic
                  ) -> CacheObserver:
    """The observer an engine's settings ask for (``kv_cache_metrics`` and its sample rate)."""
    return CacheObserver(rate if metrics else None, clock)
