"""The router's exact index of the workers' caches, built from their KV events.

``holders`` maps a block hash to the set of workers whose cache holds that block; a request's
chained block hashes (:func:`prefixkv.kv_events.block_hashes`) then give, per worker, the
number of leading blocks it holds (:meth:`ExactIndex.match`). Events are applied in sequence
order by the worker's stream (:mod:`prefixkv.router.kv_stream`); the index itself is pure and
single-threaded (the router's event loop).

Per worker it keeps whether it is **live** (a batch arrived since the stream started, so its
block size is known and its index is in use) and **complete** (every batch since the worker's
cache was last known empty was applied: its first batch was sequence 0, or an
``AllBlocksCleared`` came since). After an unrecoverable sequence gap the worker's blocks are
dropped and it is incomplete: what the index still learns is true but partial, so the policy
also looks at its approximate tree for that worker (see :mod:`prefixkv.router.precise`).

**Re-hashing** (``rehash=True``, for workers whose block hashes are not prefixkv's, e.g. vLLM's
own sha256 over its hash seed): each stored block's prefixkv hash is derived from the event's
tokens and its parent's derived hash, and a map from the worker's hash to the derived one turns
removals around. A stored chain whose parent was never seen is skipped (the index stays a lower
bound). The worker's namespaces (LoRA, ``cache_salt`` in vLLM's extra keys) are not re-derived:
re-hashed blocks match unsalted prompts only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prefixkv.kv_events import (
    EVENT_FINGERPRINT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    continue_chain,
    hash_int,
)
from prefixkv.tiers.keys import BlockKeyer

__all__ = ["ExactIndex", "WorkerEvents"]


@dataclass(slots=True)
class WorkerEvents:
    """One worker's view: its cached block hashes and the stream's counters."""

    blocks: set[int] = field(default_factory=set)
    derived: dict[int | bytes, bytes] = field(default_factory=dict)  # re-hashing: theirs -> ours
    block_size: int | None = None
    live: bool = False
    complete: bool = False
    batches: int = 0
    gaps: int = 0
    restarts: int = 0
    epoch: int = 0  # bumped whenever the worker's blocks are forgotten (cleared, reset)


class ExactIndex:
    """Block hash -> workers holding it, from the workers' KV events."""

    def __init__(self, urls: Iterable[str], *, rehash: bool = False) -> None:
        self.workers = {url: WorkerEvents() for url in urls}
        self.holders: dict[int, set[str]] = {}
        self.rehash = rehash

    def apply(self, url: str, batch: KVEventBatch) -> None:
        """Apply one batch from ``url`` (in sequence order); marks the worker live."""
        w = self.workers[url]
        w.live = True
        w.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                w.block_size = event.block_size
                for h in self._ours(w, event):
                    if h not in w.blocks:
                        w.blocks.add(h)
                        self.holders.setdefault(h, set()).add(url)
            elif isinstance(event, BlockRemoved):
                if self.rehash:
                    gone = (w.derived.pop(h, None) for h in event.block_hashes)
                    self._drop(url, [hash_int(d) for d in gone if d is not None])
                else:
                    self._drop(url, [h for h in event.block_hashes if isinstance(h, int)])
            elif isinstance(event, AllBlocksCleared):
                self._drop(url, list(w.blocks))
                w.derived.clear()
                w.complete = True
                w.epoch += 1

    def _ours(self, w: WorkerEvents, event: BlockStored) -> list[int]:
        """The prefixkv hashes of a stored chain (the event's own, or re-derived)."""
        if not self.rehash:
            return [h for h in event.block_hashes if isinstance(h, int)]
        parent = None
        if event.parent_block_hash is not None:
            parent = w.derived.get(event.parent_block_hash)
            if parent is None:
                return []
        try:
            keyer = BlockKeyer(EVENT_FINGERPRINT, event.block_size)
            digests = continue_chain(keyer, parent, list(event.token_ids), None)
        except ValueError:
            return []
        w.derived.update(zip(event.block_hashes, digests))
        return [hash_int(d) for d in digests]

    def _drop(self, url: str, hashes: Iterable[int]) -> None:
        blocks = self.workers[url].blocks
        for h in hashes:
            if h in blocks:
                blocks.discard(h)
                held = self.holders.get(h)
                if held is not None:
                    held.discard(url)
                    if not held:
                        del self.holders[h]

    def reset(self, url: str, *, complete: bool, live: bool = True) -> None:
        """Forget ``url``'s blocks: its cache restarted empty (``complete=True``) or batches were
        lost (``complete=False``); ``live=False`` also stops using its index until the next
        batch (its stream is being re-established)."""
        w = self.workers[url]
        self._drop(url, list(w.blocks))
        w.derived.clear()
        w.epoch += 1
        w.complete = complete
        w.live = w.live and live

    def match(self, hashes: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """Per worker of ``urls``: how many leading blocks of ``hashes`` its cache holds."""
        counts = dict.fromkeys(urls, 0)
        alive = set(counts)
        for i, h in enumerate(hashes):
            alive &= self.holders.get(h, set())
            if not alive:
                break
            for url in alive:
                counts[url] = i + 1
        return counts

    def describe(self, url: str) -> dict[str, int]:
        """``url``'s figures for ``GET /workers`` and ``/metrics``."""
        w = self.workers[url]
        return {"exact_blocks": len(w.blocks), "events_live": int(w.live),
                "events_complete": int(w.complete), "event_batches": w.batches,
                "event_gaps": w.gaps, "event_restarts": w.restarts}
