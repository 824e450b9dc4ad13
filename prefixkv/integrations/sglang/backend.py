"""PrefixKVStorage: SGLang's ``HiCacheStorage`` (its L3, below the host pool) over prefixkv's
disk and Valkey tiers. Loaded by ``--hicache-storage-backend dynamic`` (docs/sglang.md).

One SGLang page (``get_data_page(index, flat=True)`` of the host pool: every layer's K and V of
``page_size`` tokens) is one tier record under the key
:class:`~prefixkv.integrations.sglang.config.PageKeys` gives it: checksummed (an HMAC with a
secret), so a truncated, damaged, foreign or forged record is a miss (deleted and counted),
never wrong KV. Writes go to both tiers (write-through) and return
once written: SGLang calls ``batch_set*`` from its backup thread, off the request path. Reads try
the disk, then the shared server for the rest in one round trip; a page found only on the server
is copied to the disk in the background.

Who calls what: SGLang's prefetch thread (``batch_exists``, ``batch_get_v1`` / ``batch_get``),
its backup thread (``batch_set_v1`` / ``batch_set``) and its scheduler (``get_stats``, ``clear``)
run at once; the tiers are thread safe and the metrics lists have their own lock. The host pool
is SGLang's: the backend only reads pages from it and writes the pages it was asked to fill.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from prefixkv.integrations.sglang.config import PageKeys, Shard, StorageSettings, page_layout
from prefixkv.integrations.sglang.shared_disk import SharedDiskTier
from prefixkv.tiers.codec import Payload
from prefixkv.tiers.remote import RemoteTier
from prefixkv.tiers.spec import parse_size
from prefixkv.tiers.stats import TierStats

logger = logging.getLogger(__name__)
KV_POOL = "kv"
"""SGLang's name of the KV pool (``PoolName.KV``): the only pool this backend stores."""


class PrefixKVStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped
    """SGLang pages in prefixkv's disk tier and/or a shared Valkey/Redis tier."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.settings = StorageSettings.from_extra(storage_config.extra_config)
        self.shard = Shard.of(storage_config)
        self.metrics_on = bool(storage_config.enable_storage_metrics)
        self.disk: SharedDiskTier | None = None
        self.remote: RemoteTier | None = None
        self._keys: PageKeys | None = None
        self._dtype = torch.uint8
        self._nbytes = 0
        self._tokens = 0  # per page
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}

    # --- set-up -------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the tiers for ``mem_pool_host``'s page format (SGLang calls this right after
        constructing the backend)."""
        super().register_mem_pool_host(mem_pool_host)
        self.close()
        try:  # a pool without flat pages (e.g. head_dim != v_head_dim) fails SGLang's attach here
            sample = mem_pool_host.get_dummy_flat_data_page()
            mem_pool_host.get_data_page(0, flat=True)
        except (ValueError, NotImplementedError) as exc:
            raise ValueError(f"prefixkv's SGLang backend stores flat pages, which this host pool "
                             f"({type(mem_pool_host).__name__}, layout "
                             f"{mem_pool_host.layout!r}) has not: {exc}") from exc
        self._dtype = sample.dtype
        self._nbytes = sample.numel() * sample.element_size()
        self._tokens = int(mem_pool_host.page_size)
        layout = page_layout(str(sample.dtype).removeprefix("torch."), mem_pool_host.layout,
                             sample.numel())
        self._keys = PageKeys(self.settings, self.shard, layout)
        s, secret = self.settings, (self.settings.secret or "").encode() or None
        if s.disk_dir is not None:
            pages = parse_size(s.disk_size, self._nbytes, "kv_disk_size")
            self.disk = SharedDiskTier(s.disk_dir, pages, layout, self._nbytes, secret=secret)
        if s.remote is not None:
            self.remote = RemoteTier(s.remote, layout, self._nbytes, timeout=s.remote_timeout,
                                     ttl=s.remote_ttl, secret=secret)

    def on_host_pools_registered(self) -> None:
        """Refuse hybrid models: their sidecar pools (Mamba, SWA, DSA indexer) are not stored,
        so their pages must not be offered as hits (raising here fails SGLang's attach)."""
        others = sorted(str(n) for n in getattr(self, "registered_pools", {}) if str(n) != KV_POOL)
        if others:
            raise ValueError(f"prefixkv's SGLang backend stores the KV pool only; this model also "
                             f"has {others} (a hybrid model): use SGLang's file backend for it")

    # --- the zero-copy forms over the host pool ----------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Fill the host pool's pages at ``host_indices`` (``page_size`` slots per key) from the
        tiers; per key whether it was loaded (a miss or a bad record: ``False``)."""
        slots = self._page_slots(keys, host_indices)
        if slots is None:
            return [False] * len(keys)
        start = time.perf_counter()
        payloads = self._read([self._key(k) for k in keys])
        done = []
        for slot, payload in zip(slots, payloads):
            if payload is not None:
                self.mem_pool_host.set_from_flat_data_page(slot, self._tensor(payload))
            done.append(payload is not None)
        self._record("prefetch", sum(done), start)
        return done

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; per key whether a tier
        holds it afterwards."""
        slots = self._page_slots(keys, host_indices)
        if slots is None:
            return [False] * len(keys)
        start = time.perf_counter()
        pool = self.mem_pool_host
        done = self._write([self._key(k) for k in keys],
                           [_bytes(pool.get_data_page(slot, flat=True)) for slot in slots])
        self._record("backup", sum(done), start)
        return done

    # --- SGLang's older value forms ------------------------------------------------------------
    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """The page stored under ``key`` (copied into ``target_location`` when given), or
        ``None``."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Pages for ``keys``, ``None`` for each miss (or a target of another size)."""
        start = time.perf_counter()
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for payload, target in zip(self._read([self._key(k) for k in keys]), targets):
            page = None if payload is None else self._tensor(payload)
            if page is not None and target is not None:
                if target.numel() * target.element_size() != self._nbytes:
                    logger.warning("sglang storage: a %d-byte target for a %d-byte page; a miss",
                                   target.numel() * target.element_size(), self._nbytes)
                    page = None
                else:
                    target.view(-1).view(torch.uint8).copy_(page.view(torch.uint8))
                    page = target
            out.append(page)
        self._record("prefetch", sum(p is not None for p in out), start)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store ``value`` (one page's tensor) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store ``values`` under ``keys``; ``True`` if every one is held afterwards (a value of
        another size than the host pool's page is refused)."""
        values = list(values or [])
        if len(values) != len(keys):
            logger.warning("sglang storage: %d keys with %d values; nothing stored",
                           len(keys), len(values))
            return False
        payloads = [_bytes(v) for v in values]
        if any(len(p) != self._nbytes for p in payloads):
            logger.warning("sglang storage: a page is not %d bytes; nothing stored", self._nbytes)
            return False
        start = time.perf_counter()
        done = self._write([self._key(k) for k in keys], payloads)
        self._record("backup", sum(done), start)
        return all(done)

    def exists(self, key: str) -> bool:
        """Whether some tier holds ``key`` (its record is checked when read)."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, some tier holds (SGLang's leading run): the disk
        index first, then one pipelined ``EXISTS`` round trip for the rest."""
        tier_keys = [self._key(k) for k in keys]
        n = 0
        while n < len(tier_keys) and self.disk is not None and self.disk.contains(tier_keys[n]):
            n += 1
        if n < len(tier_keys) and self.remote is not None:
            for held in self.remote.present(tier_keys[n:]):
                if not held:
                    break
                n += 1
        return n

    # --- admin ---------------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete every page of the disk tier (and, with ``kv_clear_remote``, every prefixkv
        block on the shared server: every instance's)."""
        if self.disk is not None:
            self.disk.clear()
        if self.remote is not None and self.settings.clear_remote:
            self.remote.clear()

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages per call and GB/s of prefetch
        and backup), or ``None`` when SGLang's storage metrics are off. Per-tier counters:
        :meth:`tier_stats`."""
        if not self.metrics_on:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._metrics_lock:
            for name, values in self._metrics.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics

    def tier_stats(self) -> list[TierStats]:
        """prefixkv's counters of each tier (hits, stored, corrupt, unauthenticated, errors...)."""
        out = []
        if self.disk is not None:
            out.append(self.disk.counters.snapshot(len(self.disk)))
        if self.remote is not None:
            out.append(self.remote.counters.snapshot(0))
        return out

    def close(self) -> None:
        """Finish queued writes and close the tiers (SGLang calls it on detach)."""
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.close()
        self.disk = self.remote = None

    # --- internals -----------------------------------------------------------------------------
    def _key(self, key: str) -> bytes:
        if self._keys is None:
            raise RuntimeError("register_mem_pool_host must be called before storage I/O")
        return self._keys(key)

    def _page_slots(self, keys: list[str], host_indices: torch.Tensor) -> list[int] | None:
        page = self.mem_pool_host.page_size
        if host_indices.numel() != len(keys) * page:
            logger.error("sglang storage: %d host slots for %d pages of %d tokens",
                         host_indices.numel(), len(keys), page)
            return None
        return [int(i) for i in host_indices[::page].tolist()]

    def _read(self, keys: list[bytes]) -> list[Payload | None]:
        out: list[Payload | None] = [None] * len(keys)
        disk, remote = self.disk, self.remote
        if disk is not None:
            t0 = time.perf_counter()
            out = [disk.read(k) for k in keys]
            hits = [p for p in out if p is not None]
            disk.counters.add_load(len(hits), len(hits) * self._tokens, len(hits) * self._nbytes,
                                   time.perf_counter() - t0)
        missing = [i for i, p in enumerate(out) if p is None]
        if remote is not None and missing:
            t0 = time.perf_counter()
            got = remote.read_many([keys[i] for i in missing])
            hits = [p for p in got if p is not None]
            remote.counters.add_load(len(hits), len(hits) * self._tokens,
                                     len(hits) * self._nbytes, time.perf_counter() - t0)
            for i, payload in zip(missing, got):
                out[i] = payload
                if payload is not None and disk is not None:
                    disk.submit(keys[i], payload)  # the next read is local
        return out

    def _write(self, keys: list[bytes], payloads: list[bytes]) -> list[bool]:
        disk, remote = self.disk, self.remote
        for key, payload in zip(keys, payloads):
            if disk is not None:
                disk.submit(key, payload)
            if remote is not None:
                remote.submit(key, payload)
        for tier in (disk, remote):
            if tier is not None:
                tier.flush()
        return [(disk is not None and disk.contains(k))
                or (remote is not None and remote.is_known(k)) for k in keys]

    def _tensor(self, payload: Payload) -> torch.Tensor:
        return torch.frombuffer(bytearray(payload), dtype=self._dtype)

    def _record(self, kind: str, pages: int, start: float) -> None:
        if not self.metrics_on or not pages:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * self._nbytes / seconds / 1e9)


def _bytes(page: torch.Tensor) -> bytes:
    """A page tensor's raw bytes (any dtype, any strides)."""
    flat: torch.Tensor = page.detach().reshape(-1).contiguous().view(torch.uint8)
    return bytes(flat.numpy().tobytes())
