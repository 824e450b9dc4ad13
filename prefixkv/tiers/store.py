"""TieredStore: the lower tiers (host L2, disk L3, shared remote) behind one small interface.

The KV pool is tier 0 and stays the engine's (:class:`~prefixkv.engine.kv_manager.KVManager`).
This class decides where a block's KV goes when it leaves the pool or is computed, and where a
prompt's next blocks can be found:

=====================  ==================================================================
``offload(pairs)``     write-back: blocks being evicted from the pool are copied into the
                       host tier (its LRU drops the oldest when full)
``publish(pairs, put)``  write-through: newly computed blocks are queued for the disk and
                       remote tiers (background threads; skipped when already there); ``put``
                       (:class:`Put`) says whose they are and how long to retain them
``lookup(keys)``       the longest run of leading ``keys`` some tier holds; host slots are
                       held (not evictable) until ``load`` / ``cancel``
``load(hits, ids)``    copies the hits into freshly allocated pool blocks, releases holds
``pinned``             keys of pinned prefixes: the host and disk tiers never evict them
``retain(keys, ...)``  a soft retention's priority and TTL travel with the blocks: the host
                       and disk evict them last, the remote keeps them at least the TTL
``tenant_counts()``    blocks per tenant in each tier: a tenant over its quota
                       (``kv_blocks_per_tenant``) loses its own blocks first in every tier
``prefetch(keys)``     start reading a queued request's disk/remote blocks into host
                       staging in the background (:mod:`prefixkv.tiers.prefetch`)
``clear(tiers)``       an admin reset of the named tiers (pinned keys stay)
=====================  ==================================================================

Ownership and locking, per tier (docs/tiers.md, "Ownership"):

* pool block ids stay the caller's throughout; the store only reads and writes their KV
  through the :class:`BlockTransfer` it was given, during the call;
* a host slot is free or holds exactly one key; a key looked up for a request is *held* (never
  evicted) until that request's ``load`` or ``cancel``; a *pinned* key is never evicted;
* a disk file is the disk tier's; its writer thread evicts only unpinned keys;
* remote values are shared by every engine on the server; the server evicts them.

Engine thread only (the disk and remote tiers have their own writer threads). Every lower
tier is a cache: a failed read is a miss, never wrong KV (records carry their key and a
checksum, and an HMAC when ``kv_remote_secret`` is set).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixkv.tiers.codec import Payload, secret_id
from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.host import HostTier
from prefixkv.tiers.keys import BlockKeyer
from prefixkv.tiers.pins import PinnedKeys
from prefixkv.tiers.put import PooledTenants, Put
from prefixkv.tiers.quotas import tenant_label
from prefixkv.tiers.retained import RetainedKeys
from prefixkv.tiers.prefetch import Prefetcher
from prefixkv.tiers.remote import RemoteTier
from prefixkv.tiers.spec import LOWER_TIERS, TierSpec, parse_size
from prefixkv.tiers.stats import Residency, TierStats

REMOTE_BATCH = 8
"""Blocks fetched from the remote tier per round trip."""
DEFAULT_DISK_SIZE = "10GiB"
PREFETCH_WAIT = 1.0
"""Seconds admission waits for a block the prefetch thread is reading at that moment."""


class BlockTransfer(Protocol):
    """Moves one KV block between the pool and host memory (the runner implements it)."""

    @property
    def layout(self) -> str:
        """dtype and shape of one block, e.g. ``float32:2x4x16x2x64`` (part of stored records)."""
        ...

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block."""
        ...

    def to_host(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy pool blocks into host-arena slots."""
        ...

    def from_host(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host-arena slots into pool blocks."""
        ...

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """The raw bytes of pool blocks."""
        ...

    def write_block(self, block_id: int, data: bytes | bytearray) -> None:
        """Overwrite a pool block with raw bytes from :meth:`read_blocks`."""
        ...


@dataclass(slots=True)
class TierHit:
    """One block found below the pool: its key, the tier, and its data (a held host slot, or
    the payload read from disk / remote) plus the seconds that read took."""

    key: bytes
    tier: str
    slot: int | None = None
    payload: Payload | None = None
    seconds: float = 0.0


class TieredStore:
    """The host, disk and remote tiers an engine was configured with (any subset)."""

    def __init__(
        self, keyer: BlockKeyer, transfer: BlockTransfer, *, host: HostTier | None = None,
        disk: DiskTier | None = None, remote: RemoteTier | None = None,
        prefetcher: Prefetcher | None = None, timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.keyer = keyer
        self.transfer = transfer
        self.host = host
        self.disk = disk
        self.remote = remote
        self.prefetcher = prefetcher
        self._timer = timer
        self.pinned = PinnedKeys()  # one set, shared by the tiers that evict on their own
        self.retained = RetainedKeys()  # likewise
        self._pool_tenants = PooledTenants()  # published keys' tenants, until offloaded
        for tier in (host, disk):
            if tier is not None:
                tier.pinned = self.pinned
                tier.retained = self.retained

    @classmethod
    def create(
        cls, spec: TierSpec, transfer: BlockTransfer, fingerprint: str, block_size: int,
        host_blocks: int, pool_quota: int | None = None,
    ) -> TieredStore:
        """Build the tiers ``spec`` asks for; ``host_blocks`` is the arena ``transfer`` holds;
        ``pool_quota``: the pool's ``max_cached_blocks_per_tenant``, each tier's tenant quota
        unless ``spec.blocks_per_tenant`` sets one (:meth:`TierSpec.tenant_quotas`)."""
        nbytes, layout = transfer.block_nbytes, transfer.layout
        quota = spec.tenant_quotas(pool_quota)
        secret = None if spec.remote_secret is None else spec.remote_secret.encode()
        # engines with another secret (or none) use other keys: they never read these records
        mac = "" if secret is None else f"/mac:{secret_id(secret)}"
        keyer = BlockKeyer(f"{fingerprint}/{layout}/{spec.namespace}{mac}", block_size)
        host = HostTier(host_blocks, tenant_quota=quota["host"]) if host_blocks else None
        disk = None
        if spec.disk_dir is not None:
            size = spec.disk_size if spec.disk_size is not None else DEFAULT_DISK_SIZE
            disk = DiskTier(spec.disk_dir, parse_size(size, nbytes, "kv_disk_size"), layout, nbytes,
                            secret=secret, tenant_quota=quota["disk"])
        remote = None
        if spec.remote is not None:
            try:
                remote = RemoteTier(spec.remote, layout, nbytes, timeout=spec.remote_timeout,
                                    ttl=spec.remote_ttl, secret=secret,
                                    tenant_quota=quota["remote"])
            except BaseException:
                if disk is not None:
                    disk.close()  # its writer thread started
                raise
        prefetcher = None
        if spec.prefetch_blocks and (disk is not None or remote is not None):
            prefetcher = Prefetcher(disk, remote, spec.prefetch_blocks)
        return cls(keyer, transfer, host=host, disk=disk, remote=remote, prefetcher=prefetcher)

    # ------------------------------------------------------------------ into the tiers
    def offload(self, pairs: Sequence[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Copy ``(pool block id, key)`` blocks leaving the pool into the host tier; returns the
        pairs the host tier holds afterwards (newly stored ones, not those it had already)."""
        if self.host is None or not pairs:
            return []
        ids, slots, kept = [], [], []
        tenants = self._pool_tenants
        for block_id, key in pairs:
            slot = self.host.reserve(key, tenants.pop(key))
            if slot is not None:
                ids.append(block_id)
                slots.append(slot)
                kept.append((block_id, key))
        if ids:
            self.transfer.to_host(ids, slots)
            self.host.counters.add(stored_blocks=len(ids),
                                   stored_bytes=len(ids) * self.transfer.block_nbytes)
        return [(b, k) for b, k in kept if k in self.host]  # (a tiny tier may drop its own)

    def publish(self, pairs: Sequence[tuple[int, bytes]], chain: Sequence[bytes] = (),
                put: Put | None = None) -> None:
        """Queue newly computed ``(pool block id, key)`` blocks for the disk and remote tiers;
        ``chain``: the keys of the whole prefix they extend (theirs included), then marked
        most recently used on disk, head first (see :meth:`DiskTier.touch`). ``put``: the
        blocks' tenant (counted in every tier, the host's when they are offloaded) and a
        retention (its ``priority`` and ``ttl_s``: retains the chain in every tier,
        :meth:`retain`)."""
        put = put if put is not None else Put()
        tenant = tenant_label(put.tenant)
        if self.host is not None:
            self._pool_tenants.add([k for _, k in pairs], tenant)
        disk, remote = self.disk, self.remote
        todo = [
            (b, k) for b, k in pairs
            if (disk is not None and not disk.contains(k))
            or (remote is not None and not remote.is_known(k))
        ]
        if todo:
            payloads = self.transfer.read_blocks([b for b, _ in todo])
            for (_, key), payload in zip(todo, payloads):
                if disk is not None:
                    disk.submit(key, payload, tenant)
                if remote is not None:
                    remote.submit(key, payload, tenant)
        if disk is not None and chain:
            disk.touch(chain)
        if put.retention is not None:
            self.retain(chain or [k for _, k in pairs], put.retention.priority,
                        put.retention.ttl_s)

    # ------------------------------------------------------------------ out of the tiers
    def prefetch(self, job: int, keys: Sequence[bytes]) -> bool:
        """Start reading ``keys`` (a queued request's blocks below the host tier, in chain
        order) into host staging off the engine thread; ``False`` if not started. ``job``
        names the request for :meth:`cancel_prefetch`."""
        return self.prefetcher is not None and self.prefetcher.submit(job, keys)

    def cancel_prefetch(self, job: int) -> None:
        """Stop reading ahead for request ``job`` (it is admitted or gone)."""
        if self.prefetcher is not None:
            self.prefetcher.cancel(job)

    def names(self) -> list[str]:
        """The lower tiers this store has, in lookup order."""
        return [n for n in LOWER_TIERS if getattr(self, n) is not None]

    def sources(self, keys: Sequence[bytes]) -> list[str]:
        """The tier each of the leading ``keys`` would be read from (host, then disk, then
        remote, as :meth:`lookup` looks), up to the first key no tier holds; nothing is read,
        held or reordered (a remote tier is asked once, pipelined ``EXISTS``)."""
        checks: list[tuple[str, list[bool]]] = []
        if self.host is not None:
            checks.append(("host", [k in self.host for k in keys]))
        if self.disk is not None:
            checks.append(("disk", [self.disk.contains(k) for k in keys]))
        if self.remote is not None:
            checks.append(("remote", self.remote.present(keys)))
        out: list[str] = []
        for j in range(len(keys)):
            name = next((n for n, found in checks if found[j]), None)
            if name is None:
                break
            out.append(name)
        return out

    def lookup(self, keys: Sequence[bytes]) -> list[TierHit]:
        """Hits for the longest run of leading ``keys`` found in some tier (host first, then
        prefetched blocks, disk, remote). Host hits stay held until :meth:`load` or
        :meth:`cancel`."""
        hits: list[TierHit] = []
        fetched: dict[int, tuple[Payload | None, float]] = {}
        for j, key in enumerate(keys):
            hit = self._find(j, key, keys, fetched)
            if hit is None:
                break
            hits.append(hit)
        if hits and self.host is not None:  # recency per chain, head first (the disk's is
            self.host.touch([h.key for h in hits])  # set when the loaded chain is published)
        return hits

    def _find(
        self, j: int, key: bytes, keys: Sequence[bytes], fetched: dict[int, tuple[Payload | None, float]]
    ) -> TierHit | None:
        if self.host is not None:
            slot = self.host.hold(key)
            if slot is not None:
                return TierHit(key, "host", slot=slot)
        if self.prefetcher is not None:
            staged = self.prefetcher.take(key, wait=PREFETCH_WAIT)
            if staged is not None:  # read off the request path: only the copy counts now
                return TierHit(key, staged.tier, payload=staged.payload)
        if self.disk is not None and self.disk.contains(key):
            t0 = self._timer()
            payload: Payload | None = self.disk.read(key)
            if payload is not None:
                return TierHit(key, "disk", payload=payload, seconds=self._timer() - t0)
        if self.remote is None:
            return None
        if j not in fetched:
            batch = list(keys[j : j + REMOTE_BATCH])
            t0 = self._timer()
            got = self.remote.read_many(batch)
            each = (self._timer() - t0) / len(batch)
            for i, payload in enumerate(got):
                fetched[j + i] = (payload, each)
        payload, seconds = fetched[j]
        return None if payload is None else TierHit(key, "remote", payload=payload, seconds=seconds)

    def load(self, hits: Sequence[TierHit], block_ids: Sequence[int]) -> None:
        """Copy ``hits`` into the pool blocks ``block_ids`` (one each, same order); releases
        the host holds. The caller owns the blocks before and after."""
        nbytes = self.transfer.block_nbytes
        host = [(h, b) for h, b in zip(hits, block_ids) if h.tier == "host"]
        if host and self.host is not None:
            t0 = self._timer()
            self.transfer.from_host([h.slot for h, _ in host], [b for _, b in host])  # type: ignore[misc]
            secs = self._timer() - t0
            for h, _ in host:
                self.host.release(h.key)
            self.host.counters.add_load(len(host), len(host) * self.keyer.block_size,
                                        len(host) * nbytes, secs)
        for h, b in zip(hits, block_ids):
            if h.payload is None:
                continue
            t0 = self._timer()
            self.transfer.write_block(b, h.payload)
            tier = self.disk if h.tier == "disk" else self.remote
            assert tier is not None
            tier.counters.add_load(1, self.keyer.block_size, nbytes, h.seconds + self._timer() - t0)

    def cancel(self, hits: Sequence[TierHit]) -> None:
        """Give up ``hits`` without loading them (releases host holds)."""
        if self.host is not None:
            for h in hits:
                if h.tier == "host":
                    self.host.release(h.key)

    # ------------------------------------------------------------------ admin
    def pin(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Pin a prefix's block ``keys`` (held in the pool blocks ``block_ids``, same order)
        in every tier: the host and disk skip them when evicting; the remote tier counts the
        pin on the server and stores the blocks without an expiry (their KV read now)."""
        self.pinned.add(keys)
        if self.remote is not None and keys:
            self.remote.pin(keys, self.transfer.read_blocks(list(block_ids)))

    def retain(self, keys: Sequence[bytes], priority: int, ttl_s: float) -> None:
        """Retain a prefix's block ``keys`` in every tier (renewed by each call): the host and
        disk evict them after every unretained key, lowest ``priority`` first, until ``ttl_s``
        seconds from now; the remote tier keeps them at least that long."""
        self.retained.add(keys, priority, ttl_s)
        if self.remote is not None and keys:
            self.remote.retain(keys, ttl_s)

    def observe(self, residency: Callable[[str], Residency | None]) -> None:
        """Have the host and disk tiers report their blocks' lives to ``residency(tier)``
        (the engine's sampled residency metrics; ``None``: not reported)."""
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is not None:
                tier.residency = residency(name)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo one :meth:`pin` of ``keys``."""
        self.pinned.remove(keys)
        if self.remote is not None:
            self.remote.unpin(keys)

    def clear_host(self) -> int:
        """Drop the host tier's unpinned blocks; returns how many."""
        return self.host.clear() if self.host is not None else 0

    def clear(self, tiers: Iterable[str]) -> dict[str, int | None]:
        """Drop the unpinned blocks of the configured tiers among ``tiers`` (names from
        ``host``, ``disk``, ``remote``); per tier, how many were dropped (``None``: the remote
        could not be reached). Clearing ``remote`` deletes every prefixkv block on that
        server, other workers' included: it is one shared tier."""
        out: dict[str, int | None] = {}
        names = set(tiers)
        if self.host is not None and "host" in names:
            out["host"] = self.host.clear()
        if self.prefetcher is not None and names & {"disk", "remote"}:
            self.prefetcher.clear()
        if self.disk is not None and "disk" in names:
            out["disk"] = self.disk.clear()
        if self.remote is not None and "remote" in names:
            out["remote"] = self.remote.clear()
        return out

    def stats(self) -> list[TierStats]:
        """A snapshot per configured tier, top down."""
        out = []
        if self.host is not None:
            out.append(self.host.counters.snapshot(len(self.host)))
        if self.disk is not None:
            out.append(self.disk.counters.snapshot(len(self.disk)))
        if self.remote is not None:
            out.append(self.remote.counters.snapshot(0))
        return out

    def tenant_counts(self) -> dict[str, dict[str, int]]:
        """Blocks per tenant label (:func:`~prefixkv.tiers.quotas.tenant_label`) in each
        configured tier, top down; the remote's (every worker's blocks, read from the server)
        only with a quota and while it answers."""
        out: dict[str, dict[str, int]] = {}
        if self.host is not None:
            out["host"] = self.host.tenants.counts()
        if self.disk is not None:
            out["disk"] = self.disk.tenant_counts()
        if self.remote is not None:
            remote = self.remote.tenant_counts()
            if remote is not None:
                out["remote"] = remote
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued disk/remote writes are done; ``False`` on timeout."""
        ok = True
        for tier in (self.disk, self.remote):
            if tier is not None:
                ok = tier.flush(timeout) and ok
        return ok

    def close(self, *, wait: bool = True) -> None:
        """Finish queued writes and stop the writer threads (``wait=False``: return at once,
        the threads finish on their own: a dropped engine's finalizer). Idempotent."""
        if self.prefetcher is not None:
            self.prefetcher.close(wait=wait)
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.close(wait=wait)

