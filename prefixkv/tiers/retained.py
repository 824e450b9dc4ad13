"""RetainedKeys: the tier keys of soft-retained prefixes, which lower tiers evict last.

A request's soft retention (a priority 0-100 and a TTL, ``prefixkv.cache.Retention``) keeps
its prefix in the pool; its blocks' tier keys carry the same retention down: the host and disk
tiers choose victims among unretained keys first (their own LRU order), then retained ones,
lowest priority first, in their own order within a priority (:meth:`RetainedKeys.victims`),
until the TTL runs out; the remote tier stores them with an expiry at least as long
(:meth:`~prefixkv.tiers.remote.RemoteTier.retain`). A key retained again keeps the higher
priority (on a tie, the later expiry), as the pool does. Pinned keys still win: the tiers
skip them before asking here.

Retentions are the engine's state, like pins: kept in memory, shared by the host and disk
tiers, not written to disk (a restarted engine starts with none). Expired keys are pruned
lazily. Thread safe: the disk writer thread asks while the engine thread retains.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from itertools import islice

PRUNE_EVERY = 1024
"""Keys retained between two sweeps of expired ones."""


class RetainedKeys:
    """Tier key -> (priority, expiry on ``clock``) of retained prefixes' blocks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[bytes, tuple[int, float]] = {}
        self._added = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def add(self, keys: Iterable[bytes], priority: int, ttl_s: float) -> None:
        """Retain ``keys`` at ``priority`` for ``ttl_s`` seconds from now (renewing them)."""
        now = self._clock()
        asked = (priority, now + ttl_s)
        with self._lock:
            for k in keys:
                old = self._keys.get(k)
                if old is None or old[1] <= now or asked[0] > old[0]:
                    self._keys[k] = asked
                elif asked[0] == old[0] and asked[1] > old[1]:
                    self._keys[k] = asked
                self._added += 1
            if self._added >= PRUNE_EVERY:
                self._added = 0
                self._keys = {k: v for k, v in self._keys.items() if v[1] > now}

    def priority(self, key: bytes) -> int | None:
        """``key``'s live retention priority, or ``None``."""
        with self._lock:
            got = self._keys.get(key)
        return None if got is None or got[1] <= self._clock() else got[0]

    def victims(self, candidates: Iterable[bytes], n: int) -> list[bytes]:
        """The first ``n`` of ``candidates`` (evictable keys, in the tier's own order) to evict:
        the unretained ones in that order, then retained ones by priority (in that order within
        one)."""
        if n <= 0:
            return []
        with self._lock:
            if not self._keys:
                return list(islice(candidates, n))
            now = self._clock()
            plain: list[bytes] = []
            kept: list[tuple[int, int, bytes]] = []
            for i, k in enumerate(candidates):
                got = self._keys.get(k)
                if got is None or got[1] <= now:
                    plain.append(k)
                    if len(plain) == n:
                        return plain
                else:
                    kept.append((got[0], i, k))
        kept.sort()
        return plain + [k for *_, k in kept[: n - len(plain)]]

    def clear(self) -> None:
        """Forget every retention (a cache reset)."""
        with self._lock:
            self._keys.clear()
