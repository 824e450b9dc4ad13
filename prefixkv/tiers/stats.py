"""Per-tier counters and their snapshot (``EngineStats.tiers``)."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's counters since start (blocks and bytes; seconds of loading).

    ``hits``: blocks a request took from this tier (its tokens: ``hit_tokens``).
    ``stored_blocks`` / ``stored_bytes``: blocks written into it. ``loaded_bytes``: bytes
    read back into the KV pool; ``load_seconds``: time spent doing so (mean load latency per
    block is ``load_seconds / hits``). ``evictions``: blocks it dropped for room.
    ``occupancy_blocks`` / ``capacity_blocks``: what it holds now / at most (0: unbounded or
    unknown, for the remote tier). ``errors``: failed calls (remote down, disk I/O);
    ``corrupt``: records rejected by the checksum/header check (deleted, never used);
    ``unauthenticated``: records whose MAC failed or was missing with ``kv_remote_secret``
    set (tampered, or written by an engine without the secret; misses, deleted like corrupt ones).
    ``dropped``: writes skipped because the writer queue was full. ``prefetched``: blocks
    read ahead into host staging for a queued request (``load_seconds`` counts only the
    time on the request path, so a prefetched block's read is not in it).
    """

    tier: str
    hits: int
    hit_tokens: int
    stored_blocks: int
    stored_bytes: int
    loaded_bytes: int
    load_seconds: float
    evictions: int
    occupancy_blocks: int
    capacity_blocks: int
    errors: int
    corrupt: int
    dropped: int
    prefetched: int = 0
    unauthenticated: int = 0


class TierCounters:
    """Mutable counters of one tier; thread safe (writer threads update them too)."""

    def __init__(self, tier: str, capacity_blocks: int) -> None:
        self.tier = tier
        self.capacity_blocks = capacity_blocks
        self._lock = threading.Lock()
        self._n = dict.fromkeys(
            ("hits", "hit_tokens", "stored_blocks", "stored_bytes", "loaded_bytes", "evictions",
             "errors", "corrupt", "dropped", "prefetched", "unauthenticated"), 0)
        self._load_seconds = 0.0

    def add(self, **counts: int) -> None:
        """Add to named counters."""
        with self._lock:
            for name, v in counts.items():
                self._n[name] += v

    def add_load(self, blocks: int, tokens: int, nbytes: int, seconds: float) -> None:
        """Record ``blocks`` hits loaded into the pool."""
        with self._lock:
            self._n["hits"] += blocks
            self._n["hit_tokens"] += tokens
            self._n["loaded_bytes"] += nbytes
            self._load_seconds += seconds

    def get(self, name: str) -> int:
        """One counter's value."""
        with self._lock:
            return self._n[name]

    def snapshot(self, occupancy_blocks: int) -> TierStats:
        """The counters now."""
        with self._lock:
            n = dict(self._n)
            secs = self._load_seconds
        return TierStats(self.tier, n["hits"], n["hit_tokens"], n["stored_blocks"],
                         n["stored_bytes"], n["loaded_bytes"], secs, n["evictions"],
                         occupancy_blocks, self.capacity_blocks, n["errors"], n["corrupt"],
                         n["dropped"], n["prefetched"], n["unauthenticated"])


class Residency(Protocol):
    """Where a tier reports its blocks' lives (the engine's sampled residency metrics,
    ``prefixkv.engine.residency``); keys are tier keys."""

    def stored(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were stored."""

    def hit(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were read for a request."""

    def evicted(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were evicted for room."""
