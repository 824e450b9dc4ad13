"""The router's exact index of the workers' caches, built from their KV events.

``holders`` maps a block hash to the set of workers whose cache holds that block; a request's
chained block hashes (:func:`prefixkv.wire.kv_events.block_hashes`) then give, per worker, the
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
bound). The worker's namespaces are not re-derived: a block stored with ``extra_keys`` (vLLM
puts multimodal ids, the LoRA name and ``cache_salt`` there), a ``lora_name``, or no tokens (a
salted prefixkv block) is not indexed, nor is any block after it, so re-hashed blocks match
unsalted base-model prompts only and never a tenant's salted ones.

**Tiers.** A block may be held in several of a worker's tiers at once (vLLM's offloading
connector stores a CPU copy of a GPU block). Each event's ``medium`` names one
(:func:`tier_of`: the pool, ``host``, ``disk`` or ``remote``); a removal removes that tier's copy
only. :meth:`ExactIndex.match` counts a worker's leading blocks held in any tier, each weighted by
its best tier (:class:`TierWeights`: a block the worker must load from disk is worth less than one
in its pool).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prefixkv.wire.kv_events import (
    EVENT_FINGERPRINT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    continue_chain,
    hash_int,
)
from prefixkv.tiers.keys import BlockKeyer

__all__ = ["TIERS", "ExactIndex", "TierWeights", "WorkerEvents", "tier_of"]

TIERS = ("pool", "host", "disk", "remote")
_BITS = {name: 1 << i for i, name in enumerate(TIERS)}
_MEDIA = {"": "pool", "gpu": "pool", "pool": "pool", "device": "pool", "hbm": "pool",
          "cpu": "host", "host": "host", "cpu_tier": "host", "dram": "host",
          "disk": "disk", "ssd": "disk", "nvme": "disk", "file": "disk", "local_disk": "disk"}


def tier_of(medium: str | None) -> str:
    """The tier an event's ``medium`` names: ``None`` / ``GPU`` (vLLM's device pool) -> ``pool``,
    ``CPU`` -> ``host``, ``DISK`` -> ``disk``, anything else (Valkey, LMCache's remote
    backends, another node) -> ``remote``. Case-insensitive."""
    return _MEDIA.get((medium or "").lower(), "remote")


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What a cached block is worth by the tier holding it (llm-d scores a CPU-tier block 0.8
    of a GPU one). ``ValueError`` for a weight outside [0, 1]."""

    pool: float = 1.0
    host: float = 0.8
    disk: float = 0.25
    remote: float = 0.25

    def __post_init__(self) -> None:
        for name in TIERS:
            w = getattr(self, name)
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.0 <= w <= 1.0:
                raise ValueError(f"kv_tier_weights.{name} must be a number in [0, 1], got {w!r}")

    @classmethod
    def parse(cls, text: str | Mapping[str, float] | TierWeights | None) -> TierWeights:
        """From ``"pool=1,host=0.8,disk=0.25,remote=0.25"`` (any subset) or a mapping."""
        if text is None or isinstance(text, TierWeights):
            return text or cls()
        items: dict[str, float] = {}
        if isinstance(text, str):
            for part in filter(None, (p.strip() for p in text.split(","))):
                name, sep, value = part.partition("=")
                try:
                    items[name.strip()] = float(value)
                except ValueError:
                    raise ValueError(f"kv_tier_weights: {part!r} is not TIER=NUMBER") from None
                if not sep:
                    raise ValueError(f"kv_tier_weights: {part!r} is not TIER=NUMBER")
        else:
            items = dict(text)
        unknown = sorted(set(items) - set(TIERS))
        if unknown:
            raise ValueError(f"kv_tier_weights has unknown tiers {unknown}; known: {list(TIERS)}")
        return cls(**items)

    def of(self, mask: int) -> float:
        """The best weight among the tiers in ``mask``."""
        return max((getattr(self, t) for t in TIERS if mask & _BITS[t]), default=0.0)


@dataclass(slots=True)
class WorkerEvents:
    """One worker's view: its cached block hashes (each with a mask of the tiers holding it)
    and the stream's counters (``batches`` applied, ``undecodable`` ones)."""

    blocks: dict[int, int] = field(default_factory=dict)
    derived: dict[int | bytes, bytes] = field(default_factory=dict)  # re-hashing: theirs -> ours
    block_size: int | None = None
    live: bool = False
    complete: bool = False
    batches: int = 0
    undecodable: int = 0
    gaps: int = 0
    restarts: int = 0
    epoch: int = 0  # bumped whenever the worker's blocks are forgotten (cleared, reset)


class ExactIndex:
    """Block hash -> workers holding it, from the workers' KV events."""

    def __init__(self, urls: Iterable[str], *, rehash: bool = False,
                 weights: TierWeights | None = None) -> None:
        self.workers = {url: WorkerEvents() for url in urls}
        self.holders: dict[int, set[str]] = {}
        self.rehash = rehash
        self.weights = weights or TierWeights()

    def apply(self, url: str, batch: KVEventBatch) -> None:
        """Apply one batch from ``url`` (in sequence order); marks the worker live."""
        w = self.workers[url]
        w.live = True
        w.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                w.block_size = event.block_size
                bit = _BITS[tier_of(event.medium)]
                for h in self._ours(w, event):
                    if h not in w.blocks:
                        self.holders.setdefault(h, set()).add(url)
                    w.blocks[h] = w.blocks.get(h, 0) | bit
            elif isinstance(event, BlockRemoved):
                bit = _BITS[tier_of(event.medium)]
                if not self.rehash:
                    self._drop(url, [h for h in event.block_hashes if isinstance(h, int)], bit)
                    continue
                derived = (w.derived.get(h) for h in event.block_hashes)
                self._drop(url, [hash_int(d) for d in derived if d is not None], bit)
                for theirs in event.block_hashes:  # forget the mapping once no tier holds it
                    d = w.derived.get(theirs)
                    if d is not None and hash_int(d) not in w.blocks:
                        del w.derived[theirs]
            elif isinstance(event, AllBlocksCleared):
                self._drop(url, list(w.blocks))
                w.derived.clear()
                w.complete = True
                w.epoch += 1

    def _ours(self, w: WorkerEvents, event: BlockStored) -> list[int]:
        """The prefixkv hashes of a stored chain (the event's own, or re-derived)."""
        if not self.rehash:
            return [h for h in event.block_hashes if isinstance(h, int)]
        if (not event.token_ids or event.lora_name is not None
                or any(event.extra_keys or ())):  # (None / empty per block: plain)
            return []  # another namespace (or withheld tokens): not re-derivable
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

    def _drop(self, url: str, hashes: Iterable[int], bits: int = -1) -> None:
        """Remove ``url``'s copies of ``hashes`` in the tiers ``bits`` (all by default)."""
        blocks = self.workers[url].blocks
        for h in hashes:
            if h in blocks:
                left = blocks[h] & ~bits
                if left:
                    blocks[h] = left
                    continue
                del blocks[h]
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

    def match(self, hashes: Sequence[int], urls: Iterable[str]) -> dict[str, float]:
        """Per worker of ``urls``: its leading blocks of ``hashes`` held in any tier, each
        counted with its best tier's weight (all in the pool: the number of blocks)."""
        counts = dict.fromkeys(urls, 0.0)
        alive = set(counts)
        weigh = self.weights.of
        for h in hashes:
            alive &= self.holders.get(h, set())
            if not alive:
                break
            for url in alive:
                counts[url] += weigh(self.workers[url].blocks[h])
        return counts

    def describe(self, url: str) -> dict[str, int]:
        """``url``'s figures for ``GET /workers`` and ``/metrics``."""
        w = self.workers[url]
        return {"exact_blocks": len(w.blocks), "events_live": int(w.live),
                "events_complete": int(w.complete), "event_batches": w.batches,
                "event_undecodable": w.undecodable, "event_gaps": w.gaps,
                "event_restarts": w.restarts}
