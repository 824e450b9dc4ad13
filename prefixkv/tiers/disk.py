"""DiskTier (L3): one file per block under a directory, written off the request path.

A file is ``<key hex>.kvb`` holding one :mod:`~prefixkv.tiers.codec` record, written to a
temporary name ``<key hex>.kvb.<pid>.<writer>.tmp`` and renamed into place (a crash leaves such
a ``.tmp`` file, never a half-written ``.kvb``). At start the directory is indexed again (oldest
modification time first), which is what makes a restarted engine answer from disk.

Only the tier's own files are ever deleted (the directory may hold anything else): a ``.kvb``
counts as its own when its name is a key and its header is a record of that key in this tier's
layout (with a MAC exactly when the tier has a secret), or it is empty (it holds nothing; a
power loss can leave one); anything else is neither indexed nor touched. A ``.tmp`` file is
removed at start only when its name is one this tier's writers use and its writer is gone (no
such process here) or it is older than :data:`STALE_TMP_S`. Engines of one KV layout sharing a
directory therefore share its files (capacity, reset): give each model its own directory.

Reads check the record (magic, version, key, layout, length, xxhash64; the MAC with a
secret); a corrupt or truncated file is a miss and is deleted. A read refreshes the file's
mtime; where that fails (a read-only directory) the hit stands, with one warning (then one a
minute). Capacity is in blocks; the least recently used file goes first, skipping pinned keys
(:class:`~prefixkv.tiers.pins.PinnedKeys`) and taking soft-retained keys only after every other
(:class:`~prefixkv.tiers.retained.RetainedKeys`, an index in memory: retentions are not written
to disk): when only pinned or retained files could make room, the new block is the one not kept. Recency is per prefix chain, with the pool's tie-break:
:meth:`DiskTier.touch` makes a chain the most recent with its *first* block the most recent of
all, so a full tier drops a prompt's tail before its head (a head block lost makes
every block after it unreachable). The writer thread stamps the same order into the files'
mtimes, so it survives a restart.

Tenants (:class:`~prefixkv.tiers.quotas.TenantKeys`): each file's header carries its tenant's
label (none for the default tenant, as records written before tenants were counted), so a
restart counts blocks per tenant again; with a quota, an over-quota tenant's own files go
first, in the same LRU order.

Threads: the engine thread calls :meth:`contains` / :meth:`read` / :meth:`submit`; the writer
thread writes and evicts. The index is guarded by one lock.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixkv.tiers.codec import (
    TENANT_BYTES,
    CorruptBlockError,
    Payload,
    UnauthenticatedBlockError,
    decode,
    encode,
    header_size,
    is_record_of,
    record_tenant,
)
from prefixkv.tiers.pins import PinnedKeys
from prefixkv.tiers.quotas import DEFAULT_TENANT, TenantKeys
from prefixkv.tiers.retained import RetainedKeys
from prefixkv.tiers.stats import Residency, TierCounters
from prefixkv.tiers.writer import BackgroundWriter

logger = logging.getLogger(__name__)
SUFFIX = ".kvb"
KEY_BYTES = 32
"""Length of a block key (sha256)."""
WARN_EVERY_S = 60.0
"""Write and read failures are logged at most this often (each one is counted in ``errors``)."""
STALE_TMP_S = 60.0
"""A temporary file of ours this old is a crashed write's leftover (a write takes milliseconds)."""
TMP_NAME = re.compile(r"^(?:[0-9a-f]{64}\.kvb|\.probe)\.(\d+)\.[0-9a-f]+\.tmp$")
"""The temporary names this module writes (block writes and the start-up probe)."""


class DiskTier:
    """Blocks as files in ``directory``, at most ``capacity`` of them (``tenant_quota``: files
    a tenant keeps before its own go first; ``None``: no quota)."""

    def __init__(
        self, directory: str | Path, capacity: int, layout: str, nbytes: int,
        pinned: PinnedKeys | None = None, clock: Callable[[], float] = time.monotonic,
        secret: bytes | None = None, tenant_quota: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"kv_disk_size must be >= 1 block, got {capacity}")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"kv_disk_dir {str(directory)!r} is not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _probe_write(self.directory)  # a directory it cannot write to fails here, not per block
        except OSError as exc:
            raise ValueError(f"kv_disk_dir {str(directory)!r} is not usable: {exc}") from exc
        self.capacity = capacity
        self.layout = layout
        self.nbytes = nbytes
        self.counters = TierCounters("disk", capacity)
        self._secret = secret
        self._clock = clock
        self._unreported: dict[str, int] = {}  # failures of a kind since its last warning
        self._warned_at: dict[str, float] = {}
        self.pinned = pinned if pinned is not None else PinnedKeys()
        self.retained = RetainedKeys(clock)  # shared with the host tier by a TieredStore
        self.residency: Residency | None = None  # sampled block lives (kv_cache_metrics)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # LRU first; pending keys too
        self._pending: set[bytes] = set()  # submitted, not written yet (never evicted)
        self.tenants = TenantKeys(tenant_quota)  # the indexed keys per tenant (the lock's)
        # the KV event sink's hooks: keys written / keys that left (any thread may call them)
        self.on_stored: Callable[[list[bytes]], None] | None = None
        self.on_drop: Callable[[list[bytes]], None] | None = None
        self._scan()
        self._writer: BackgroundWriter[tuple[bytes, Payload | None, str]] = BackgroundWriter(
            "prefixkv-disk-writer", self._job, self._write_failed)

    def _scan(self) -> None:
        files = []
        peek = header_size(self.layout) + TENANT_BYTES
        for p in self.directory.iterdir():
            tmp = TMP_NAME.match(p.name)
            if tmp is not None:
                if _stale_tmp(p, int(tmp.group(1))):
                    _unlink(p)
            elif p.suffix == SUFFIX and len(p.stem) == 64:
                try:
                    key = bytes.fromhex(p.stem)
                    with open(p, "rb") as f:
                        head = f.read(peek)
                        mtime = os.fstat(f.fileno()).st_mtime_ns
                except (OSError, ValueError):
                    continue
                if p.name == key.hex() + SUFFIX and (not head or is_record_of(
                        head, key, self.layout, self._secret is not None)):
                    files.append((mtime, key, p, record_tenant(head, self.layout)))  # ours
        files.sort()  # (or empty: a power loss's): indexed
        for _, key, p, tenant in files[max(0, len(files) - self.capacity):]:
            self._index[key] = None
            self.tenants.add(key, tenant or DEFAULT_TENANT)
        for _, _, p, _ in files[: max(0, len(files) - self.capacity)]:
            _unlink(p)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index) - len(self._pending)

    def path(self, key: bytes) -> Path:
        """The file of ``key``."""
        return self.directory / (key.hex() + SUFFIX)

    def contains(self, key: bytes) -> bool:
        """Whether a file for ``key`` is indexed (or queued to be written)."""
        with self._lock:
            return key in self._index

    def submit(self, key: bytes, payload: Payload, tenant: str = DEFAULT_TENANT) -> None:
        """Queue ``payload`` (one block's KV bytes) to be written under ``key`` for ``tenant``
        (a :func:`~prefixkv.tiers.quotas.tenant_label`); it takes its place in the LRU order now
        (most recent)."""
        with self._lock:
            if key in self._index:
                return
            self._pending.add(key)
            self._index[key] = None
            self.tenants.add(key, tenant)
        if not self._writer.submit((key, payload, tenant)):
            with self._lock:
                self._pending.discard(key)
                self._index.pop(key, None)
                self.tenants.remove([key])
            self.counters.add(dropped=1)

    def touch(self, chain: Sequence[bytes]) -> None:
        """Mark ``chain`` (one prefix's keys, first block first) the most recently used, its
        first block most of all; keys not stored are skipped."""
        with self._lock:
            index, tenants = self._index, self.tenants
            for k in reversed(chain):
                if k in index:
                    index.move_to_end(k)
                    tenants.touch(k)
        # the same order in the files' mtimes (what a restart indexes by), off the request path
        self._writer.submit((b"".join(chain), None, ""))

    def read(self, key: bytes) -> bytes | None:
        """The payload stored under ``key``, or ``None`` (absent, unreadable or corrupt)."""
        with self._lock:
            if key not in self._index or key in self._pending:
                return None
            self._index.move_to_end(key)
            self.tenants.touch(key)
        path = self.path(key)
        try:
            record = path.read_bytes()
            payload = decode(record, key, self.layout, self.nbytes, self._secret)
        except FileNotFoundError:
            self._forget(key)
            return None
        except CorruptBlockError as exc:
            forged = isinstance(exc, UnauthenticatedBlockError)
            logger.warning("disk tier: %s is %s (%s); removed", path.name,
                           "unauthenticated" if forged else "corrupt", exc)
            self.counters.add(**{"unauthenticated" if forged else "corrupt": 1})
            self._forget(key)
            _unlink(path)
            return None
        except OSError as exc:
            self.counters.add(errors=1)
            self._warn("read", f"cannot read {path.name}: {exc}", "that block is recomputed")
            return None
        if self.residency is not None:
            self.residency.hit([key])
        try:
            os.utime(path)
        except OSError as exc:  # read-only directory: the hit stands, the recency is not kept
            self._warn("utime", f"cannot refresh {path.name}'s mtime: {exc}",
                       "reads go on; a restart may see an older recency order")
        return payload

    def tenant_counts(self) -> dict[str, int]:
        """Indexed files (queued writes included) per tenant label holding any."""
        with self._lock:
            return self.tenants.counts()

    def stored_keys(self) -> list[bytes]:
        """The indexed keys, least recently used first."""
        with self._lock:
            return [k for k in self._index if k not in self._pending]

    def clear(self) -> int:
        """Wait for queued writes, then delete every indexed file whose key is not pinned;
        returns how many were deleted."""
        self._writer.flush()
        with self._lock:
            drop = [k for k in self._index if k not in self.pinned]
            for k in drop:
                del self._index[k]
            self.tenants.remove(drop)
        for k in drop:
            _unlink(self.path(k))
        if drop and self.on_drop is not None:
            self.on_drop(drop)
        return len(drop)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued writes; ``False`` on timeout."""
        return self._writer.flush(timeout)

    def close(self, *, wait: bool = True) -> None:
        """Finish queued writes and stop the writer thread (``wait=False``: without waiting
        for it, see :meth:`BackgroundWriter.close`)."""
        self._writer.close(wait=wait)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._index.pop(key, None)
            self.tenants.remove([key])
        if self.on_drop is not None:
            self.on_drop([key])

    def _job(self, item: tuple[bytes, Payload | None, str]) -> None:
        key, payload, tenant = item
        if payload is None:
            self._stamp([key[i : i + KEY_BYTES] for i in range(0, len(key), KEY_BYTES)])
        else:
            self._write(key, payload, tenant)

    def _stamp(self, chain: list[bytes]) -> None:
        """Set the stored files of ``chain`` to strictly increasing mtimes from its tail to its
        head (now), so a restart indexes them in the order :meth:`touch` gave."""
        now = time.time_ns()
        with self._lock:
            stored = [k for k in chain if k in self._index and k not in self._pending]
        for i, k in enumerate(stored):  # head first: newest
            t = now - i * 1000
            try:
                os.utime(self.path(k), ns=(t, t))
            except OSError:  # evicted meanwhile
                continue

    def _write(self, key: bytes, payload: Payload, tenant: str = DEFAULT_TENANT) -> None:
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{id(self):x}.tmp")  # unique per writer
        tag = "" if tenant == DEFAULT_TENANT else tenant
        try:
            tmp.write_bytes(encode(key, self.layout, payload, self._secret, tag))
            os.replace(tmp, path)
        except BaseException:
            with self._lock:
                self._pending.discard(key)
                self._index.pop(key, None)
                self.tenants.remove([key])
            _unlink(tmp)
            raise
        with self._lock:
            pending = self._pending
            pending.discard(key)
            if key not in self._index:  # forgotten meanwhile: newest
                self._index[key] = None
                self.tenants.add(key, tenant)
            over = len(self._index) - len(pending) - self.capacity
            victims = self.tenants.victims(
                over, lambda k: k not in pending and k not in self.pinned, self.retained,
                self._index) if over > 0 else []
            for v in victims:
                del self._index[v]
            self.tenants.remove(victims)
        kept = key not in victims  # False: only pinned files could have made room
        self.counters.add(stored_blocks=int(kept), stored_bytes=len(payload) if kept else 0,
                          evictions=len(victims) - (not kept), dropped=int(not kept))
        for v in victims:
            _unlink(self.path(v))
        if kept and self.on_stored is not None:
            self.on_stored([key])
        gone = [v for v in victims if v != key]
        if gone and self.on_drop is not None:
            self.on_drop(gone)
        if self.residency is not None:
            self.residency.evicted(gone)
            if kept:
                self.residency.stored([key])

    def _write_failed(self, exc: BaseException) -> None:
        """Count a failed write and warn (throttled: a full or read-only disk fails every block)."""
        self.counters.add(errors=1)
        self._warn("write", f"write failed: {exc}", "requests recompute instead")

    def _warn(self, kind: str, what: str, then: str) -> None:
        """Log a failure of ``kind`` at its first occurrence and then at most every
        :data:`WARN_EVERY_S` seconds, with the count of those not logged."""
        with self._lock:
            self._unreported[kind] = self._unreported.get(kind, 0) + 1
            now, last = self._clock(), self._warned_at.get(kind)
            if last is not None and now - last < WARN_EVERY_S:
                return
            n = self._unreported[kind]
            self._warned_at[kind], self._unreported[kind] = now, 0
        more = f" ({n} failed since the last warning)" if last is not None else ""
        logger.warning("disk tier: %s%s; %s", what, more, then)


def _probe_write(directory: Path) -> None:
    """Create and remove a file in ``directory`` (``OSError`` if it cannot be written)."""
    probe = directory / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(probe, "wb") as f:
        f.write(b"prefixkv")
    probe.unlink()


def _stale_tmp(path: Path, pid: int) -> bool:
    """Whether ``path``, a temporary file of writer process ``pid``, is a leftover: that process
    is gone, or the file is older than :data:`STALE_TMP_S`."""
    try:
        if time.time() - path.stat().st_mtime > STALE_TMP_S:
            return True
    except OSError:
        return False
    if pid == os.getpid():  # another tier of this process may be writing it
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    return False


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
