"""Prefetcher: reads a waiting request's disk / remote blocks into host memory before it runs.

When a request is queued (``KVManager.prefetch``), the keys of its prompt's full blocks that
neither the pool nor the host tier holds are handed to this class; one background thread reads
them (disk first, then the remote tier in batches), verifies each record (key, layout,
checksum: the tiers' own ``read`` / ``read_many``) and *stages* the payload. When the request
is admitted, ``TieredStore.lookup`` takes staged payloads instead of reading them on the
engine thread, so the request's time in the queue hides the read.

Ownership: a staged payload is this class's until :meth:`take` pops it (then the request's
``TierHit`` holds it until the load). Staging is bounded (``capacity`` blocks; the oldest
staged block goes first) and is only an optimisation: a key not staged yet is read at
admission as before, and staged payloads are immutable copies of content-addressed blocks, so
they can never be stale or wrong. Thread safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixkv.tiers.codec import Payload
from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.remote import RemoteTier
from prefixkv.tiers.writer import BackgroundWriter

logger = logging.getLogger(__name__)
BATCH = 8
"""Blocks fetched from the remote tier per round trip."""


@dataclass(frozen=True, slots=True)
class Staged:
    """One prefetched block: the tier it came from, its payload and the seconds reading took."""

    tier: str
    payload: Payload
    seconds: float


class Prefetcher:
    """Background reads of lower-tier blocks into a bounded staging area."""

    def __init__(
        self, disk: DiskTier | None, remote: RemoteTier | None, capacity: int,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"kv_prefetch_blocks must be >= 1, got {capacity}")
        self.disk = disk
        self.remote = remote
        self.capacity = capacity
        self.enabled = True
        self._timer = timer
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._reading: frozenset[bytes] = frozenset()  # keys of the job being read now
        self._queued: set[int] = set()  # jobs submitted and not finished
        self._cancelled: set[int] = set()  # a subset of _queued
        self._staged: OrderedDict[bytes, Staged] = OrderedDict()
        self._jobs: BackgroundWriter[tuple[int, list[bytes]]] = BackgroundWriter(
            "prefixkv-prefetch", self._run, self._failed, maxsize=256)

    def __len__(self) -> int:
        with self._lock:
            return len(self._staged)

    def submit(self, job: int, keys: Sequence[bytes]) -> bool:
        """Queue job ``job`` (a request's id): read the leading run of ``keys`` found below the
        host tier. ``False`` if prefetching is off or the job queue is full (the request then
        reads at admission)."""
        if not self.enabled or not keys:
            return False
        with self._lock:
            self._queued.add(job)
        if self._jobs.submit((job, list(keys))):
            return True
        with self._lock:
            self._queued.discard(job)
        return False

    def cancel(self, job: int) -> None:
        """Stop job ``job`` (its request was admitted or dropped); what it staged stays."""
        with self._lock:
            if job in self._queued:
                self._cancelled.add(job)

    def take(self, key: bytes, wait: float = 0.0) -> Staged | None:
        """Pop the staged block of ``key`` (``None`` if not staged). With ``wait`` > 0, a key
        still queued or being read is waited for up to that many seconds (the read is under
        way: waiting for it costs less than reading the block a second time)."""
        with self._lock:
            if wait > 0 and key not in self._staged and key in self._reading:
                self._done.wait_for(lambda: key in self._staged or key not in self._reading, wait)
            return self._staged.pop(key, None)

    def clear(self) -> int:
        """Wait for queued jobs, then drop every staged block; returns how many."""
        self._jobs.flush()
        with self._lock:
            n = len(self._staged)
            self._staged.clear()
        return n

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued jobs are done; ``False`` on timeout."""
        return self._jobs.flush(timeout)

    def close(self, *, wait: bool = True) -> None:
        """Stop the thread (queued jobs run first; ``wait=False``: without waiting). Idempotent."""
        self._jobs.close(wait=wait)

    def _stage(self, key: bytes, tier: str, payload: Payload, seconds: float) -> None:
        with self._lock:
            self._staged[key] = Staged(tier, payload, seconds)
            self._staged.move_to_end(key)
            while len(self._staged) > self.capacity:
                self._staged.popitem(last=False)
            self._done.notify_all()
        counters = self.disk.counters if tier == "disk" else self.remote.counters  # type: ignore[union-attr]
        counters.add(prefetched=1)

    def _is_staged(self, key: bytes) -> bool:
        with self._lock:
            return key in self._staged

    def _run(self, item: tuple[int, list[bytes]]) -> None:
        job, keys = item
        with self._lock:
            if job in self._cancelled:
                self._cancelled.discard(job)
                self._queued.discard(job)
                return
            self._reading = frozenset(keys)
        try:
            self._read(job, keys)
        finally:
            with self._lock:
                self._reading = frozenset()
                self._cancelled.discard(job)
                self._queued.discard(job)
                self._done.notify_all()

    def _live(self, job: int, key: bytes) -> bool:
        """Whether ``job`` should still read ``key`` (not cancelled, not staged already)."""
        with self._lock:
            return self.enabled and job not in self._cancelled and key not in self._staged

    def _read(self, job: int, keys: list[bytes]) -> None:
        fetched: dict[int, tuple[Payload | None, float]] = {}
        for j, key in enumerate(keys):
            if not self._live(job, key):
                if self._is_staged(key):
                    continue
                return
            if self.disk is not None and self.disk.contains(key):
                t0 = self._timer()
                payload: Payload | None = self.disk.read(key)
                if payload is not None:
                    self._stage(key, "disk", payload, self._timer() - t0)
                    continue
            if self.remote is None or not self.remote.is_up:
                return
            if j not in fetched:
                batch = keys[j : j + BATCH]
                t0 = self._timer()
                got = self.remote.read_many(batch)
                each = (self._timer() - t0) / len(batch)
                fetched.update((j + i, (p, each)) for i, p in enumerate(got))
            payload, seconds = fetched[j]
            if payload is None:
                return  # the chain breaks here: later blocks are useless without this one
            self._stage(key, "remote", payload, seconds)

    def _failed(self, exc: BaseException) -> None:
        logger.warning("KV prefetch failed: %s", exc)
