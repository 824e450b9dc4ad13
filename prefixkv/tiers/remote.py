"""RemoteTier: blocks shared by every engine that points at one Valkey/Redis server.

A block is stored as one string value (a :mod:`~prefixkv.tiers.codec` record) under
``pkv:<key hex>``; keys are process independent (:mod:`~prefixkv.tiers.keys`), so a block one
worker publishes is a hit for every other worker running the same model. Writes go through a
background thread; reads run on the engine thread with a short socket timeout, split over a
few connections, pipelined ``GETRANGE`` batches read off the sockets straight into each value's
buffer (:mod:`~prefixkv.tiers.range_read`, :mod:`~prefixkv.tiers.bulk_read`; redis-py's own
reply parser serves the small replies). :meth:`RemoteTier.streamed` reads a batch in pieces
into the caller's buffers, each piece usable while the rest arrive (the vLLM connector's
layer-by-layer loads).

Failure policy: the remote is a cache. Any error or timeout counts in ``errors``, logs one
warning, and opens a circuit for ``retry_after`` seconds during which every read is a miss and
every write is dropped: requests then recompute; they never fail because of the remote.

Access: the URL may carry a user and password (Valkey ``AUTH``:
``redis://user:pass@host:6379/0``, ``redis://:pass@...`` for ``requirepass``) and ask for TLS
(``rediss://``, ``valkeys://``; redis-py's ``ssl_*`` query parameters, e.g.
``?ssl_ca_certs=/etc/ca.pem``); it is handed to redis-py as given (``valkey`` schemes
renamed) and never logged with its password. A refused login is a failure like any other:
counted, warned about once, requests recompute.

Authenticity: with a ``secret`` every record carries an HMAC (:mod:`~prefixkv.tiers.codec`) and
a record whose MAC fails is a miss, counted in ``unauthenticated`` and deleted; the checksum
alone stops accidents, not a client that can write to the server.

Eviction is the server's own. Soft retention (:meth:`RemoteTier.retain`): a retained prefix's
blocks get an expiry at least as long as its TTL. Pins: :meth:`RemoteTier.pin` counts a pin per block in
``pkv:pin:<key>`` (shared by every engine on the server) and makes sure the block is stored
without an expiry; unpinning the last pin gives it back its ``ttl``. Run the server with
``maxmemory-policy volatile-lru`` and give the tier a ``ttl``: unpinned blocks then carry an
expiry and are what the server evicts, pinned ones carry none and are never evicted. Under
``allkeys-lru`` (fine without pins) the server may evict pinned blocks too. A pin lives until
its engine unpins it or resets its cache; an engine that dies holding pins leaves them until a
``reset --tiers remote`` (which deletes every ``pkv:`` key, counters included).

Tenant quotas (``tenant_quota``, :mod:`~prefixkv.tiers.remote_quota`): counted on the server,
since workers share it. Each write also adds its block to its tenant's sorted set
``pkv:tq:<label>`` (scored by the write's time, in the same script call: no extra round trip),
and when that tenant holds more than its quota the script deletes its oldest blocks, skipping
pinned ones (moved to the back) and dropping members whose block already expired or was evicted
by the server. Reads do not refresh a block's place (the read path stays one ``MGET``).
:meth:`RemoteTier.tenant_counts` reads the sets' sizes, first dropping members written more than
a ``ttl`` ago whose block expired. Without a quota nothing is counted.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from prefixkv.tiers.bulk_read import BulkReader
from prefixkv.tiers.codec import CorruptBlockError, Payload, UnauthenticatedBlockError, encode
from prefixkv.tiers.range_read import MISSING, OK, Place, StreamedRead
from prefixkv.tiers.quotas import DEFAULT_TENANT
from prefixkv.tiers.remote_quota import COUNTS, SET, TENANT_PREFIX, TENANTS
from prefixkv.tiers.stats import TierCounters
from prefixkv.tiers.writer import BackgroundWriter

logger = logging.getLogger(__name__)
PREFIX = b"pkv:"
PIN_PREFIX = b"pkv:pin:"
"""Pin counters; as long as a pin exists the block it names has no expiry."""
KNOWN_KEYS = 1 << 17
"""Most keys remembered as already published (their re-publication is skipped)."""
CLEAR_BATCH = 512
COUNTS_EVERY = 5.0
"""Seconds a reading of the per-tenant counts is reused (:meth:`RemoteTier.tenant_counts`)."""
"""Keys scanned and unlinked per round trip by :meth:`RemoteTier.clear`."""

# KEYS: block, pin counter, block, pin counter, ... ARGV: each block's record, same order.
_PIN = """
for i = 1, #KEYS, 2 do
  redis.call('INCR', KEYS[i + 1])
  if redis.call('PERSIST', KEYS[i]) == 0 and redis.call('EXISTS', KEYS[i]) == 0 then
    redis.call('SET', KEYS[i], ARGV[(i + 1) / 2])
  end
end
return 0
"""
# KEYS: blocks. ARGV: seconds. A block whose expiry is sooner gets that long; one without an
# expiry (pinned, or a tier without a ttl) keeps none.
_RETAIN = """
for i = 1, #KEYS do
  local left = redis.call('TTL', KEYS[i])
  if left >= 0 and left < tonumber(ARGV[1]) then redis.call('EXPIRE', KEYS[i], ARGV[1]) end
end
return 0
"""
# KEYS as for _PIN. ARGV: ttl seconds (0: none).
_UNPIN = """
for i = 1, #KEYS, 2 do
  if redis.call('DECR', KEYS[i + 1]) <= 0 then
    redis.call('DEL', KEYS[i + 1])
    if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[i], ARGV[1]) end
  end
end
return 0
"""


class RemoteTier:
    """A Valkey/Redis-backed block store; thread safe."""

    def __init__(
        self, url: str, layout: str, nbytes: int, *, timeout: float = 0.5,
        retry_after: float = 5.0, ttl: float | None = None, secret: bytes | None = None,
        clock: Callable[[], float] = time.monotonic, tenant_quota: int | None = None,
    ) -> None:
        try:
            import redis
        except ImportError as exc:
            raise ValueError("kv_remote needs the redis client: pip install 'prefixkv[remote]'") from exc

        for ours, theirs in (("valkey://", "redis://"), ("valkeys://", "rediss://")):
            if url.startswith(ours):
                url = theirs + url[len(ours):]
        self.url = redact(url)
        """The URL without its password (for messages)."""
        try:
            self._client: Any = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as exc:
            raise ValueError(f"kv_remote {self.url!r} is not a valid redis URL: {exc}") from None
        self._bulk = BulkReader(self._client)  # GETRANGE pieces straight off the socket (bulk_read.py)
        self._secret = secret
        self.layout = layout
        self.nbytes = nbytes
        self.retry_after = retry_after
        self.ttl = 0 if ttl is None else max(1, math.ceil(ttl))  # whole seconds; 0: none
        if tenant_quota is not None and (isinstance(tenant_quota, bool)
                                         or not isinstance(tenant_quota, int) or tenant_quota < 0):
            raise ValueError(f"kv_blocks_per_tenant must be an int >= 0, got {tenant_quota!r}")
        self.tenant_quota = tenant_quota
        """Blocks a tenant keeps on the server before its oldest go (``None``: not counted)."""
        self._set = self._client.register_script(SET)
        self._counts = self._client.register_script(COUNTS)
        self._pin = self._client.register_script(_PIN)
        self._unpin = self._client.register_script(_UNPIN)
        self._retain = self._client.register_script(_RETAIN)
        self._clock = clock
        self._last_counts: tuple[float, dict[str, int]] | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self.counters = TierCounters("remote", 0)
        self._writer: BackgroundWriter[Callable[[], None]] = BackgroundWriter(
            "prefixkv-remote-writer", _call, self._failed)

    @property
    def is_up(self) -> bool:
        """``False`` while the circuit is open after a failure."""
        return self._clock() >= self._down_until

    def is_known(self, key: bytes) -> bool:
        """Whether this engine published or fetched ``key`` (recently) and has not since found
        it gone from the server (a read or a presence check that missed it)."""
        with self._lock:
            return key in self._known

    def submit(self, key: bytes, payload: bytes, tenant: str = DEFAULT_TENANT) -> None:
        """Publish ``payload`` under ``key`` for ``tenant`` (a
        :func:`~prefixkv.tiers.quotas.tenant_label`) in the background (skipped if known)."""
        if not self.is_up:
            self.counters.add(dropped=1)
            return
        with self._lock:
            if key in self._known:
                return
            self._remember(key)
        if not self._writer.submit(lambda: self._write(key, payload, tenant)):
            with self._lock:
                self._known.pop(key, None)
            self.counters.add(dropped=1)

    def pin(self, keys: Sequence[bytes], payloads: Sequence[bytes]) -> bool:
        """Pin ``keys`` once more each on the server (in the background, after the writes
        queued before), storing ``payloads`` (their KV, same order) for any the server lacks;
        a pinned block has no expiry. ``False`` if the pin could not be queued (remote down or
        the queue full: the prefix stays pinned locally, not on the server)."""
        if not keys:
            return True
        if not self.is_up:
            self.counters.add(dropped=len(keys))
            return False
        names = _pairs(keys)
        records = [encode(k, self.layout, p, self._secret) for k, p in zip(keys, payloads)]
        ok = self._writer.submit(lambda: self._pin(keys=names, args=records))
        if not ok:
            self.counters.add(dropped=len(keys))
        return ok

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo one :meth:`pin` of ``keys`` (in the background); a block whose last pin goes
        gets the tier's ``ttl`` back."""
        if keys and not self._writer.submit(lambda: self._unpin(keys=_pairs(keys), args=[self.ttl])):
            self.counters.add(dropped=len(keys))

    def retain(self, keys: Sequence[bytes], ttl_s: float) -> bool:
        """Make ``keys`` (a soft-retained prefix's blocks) live on the server at least
        ``ttl_s`` seconds from now (in the background, after the writes queued before): a
        shorter expiry is extended, a block without one keeps none. ``False`` if not queued."""
        if not keys:
            return True
        if not self.is_up:
            self.counters.add(dropped=len(keys))
            return False
        names = [PREFIX + k for k in keys]
        seconds = max(1, math.ceil(ttl_s))
        ok = self._writer.submit(lambda: self._retain(keys=names, args=[seconds]))
        if not ok:
            self.counters.add(dropped=len(keys))
        return ok

    def read_many(self, keys: Sequence[bytes]) -> list[Payload | None]:
        """Payloads for ``keys`` (``None`` for a miss); all misses while the remote is down.
        Each record is read in one piece into a buffer of its own that becomes the payload
        (:meth:`streamed`: pipelined ``GETRANGE`` batches, so the first blocks arrive while the
        server copies the rest; an ``MGET`` is sent only once the server has run all of it)."""
        if not keys or not self.is_up:
            return [None] * len(keys)
        bufs = [bytearray(self.nbytes) for _ in keys]
        read = self.streamed(keys, [0, self.nbytes], lambda i, g: [memoryview(bufs[i])])
        ok = self.read_streamed(read)
        return [b if good else None for b, good in zip(bufs, ok)]

    def streamed(self, keys: Sequence[bytes], cuts: Sequence[int], place: Place) -> StreamedRead:
        """A read of ``keys``' blocks in pieces at ``cuts``, each into ``place``'s buffers
        (:mod:`~prefixkv.tiers.range_read`); run it with :meth:`read_streamed`."""
        return StreamedRead([PREFIX + k for k in keys], keys, self.layout, self.nbytes, cuts,
                            place, self._secret, self._bulk.connections)

    def read_streamed(self, read: StreamedRead) -> list[bool]:
        """Run ``read`` (blocking; another thread may :meth:`~StreamedRead.wait` on its pieces)
        over this tier's connections: per key, whether its block arrived whole and good. Misses,
        corrupt records and failures count as in :meth:`read_many`; all fail while the remote
        is down."""
        if read.keys and self.is_up:
            try:
                read.run(self._bulk)
            except Exception as exc:  # noqa: BLE001 - any client failure degrades to a miss
                self._failed(exc)
        read.abandon()
        self._forget([k for k, st in zip(read.keys, read.state) if st == MISSING])
        for key, st in zip(read.keys, read.state):
            if isinstance(st, CorruptBlockError):
                self._corrupt(key, st)
            elif st == OK:
                with self._lock:
                    self._remember(key)
        return [st == OK for st in read.state]

    def _corrupt(self, key: bytes, exc: CorruptBlockError) -> None:
        """A record that failed its checks: counted, warned about, deleted, forgotten."""
        forged = isinstance(exc, UnauthenticatedBlockError)
        logger.warning("remote tier: block %s is %s (%s); deleted", key.hex()[:16],
                       "unauthenticated" if forged else "corrupt", exc)
        self.counters.add(**{"unauthenticated" if forged else "corrupt": 1})
        self._delete(key)
        with self._lock:  # published again by the next engine that computes it
            self._known.pop(key, None)

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the server holds each of ``keys`` (one pipelined ``EXISTS`` each; all
        ``False`` while the remote is down or when the call fails)."""
        if not keys or not self.is_up:
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(PREFIX + key)
            held = [bool(n) for n in pipe.execute()]
        except Exception as exc:  # noqa: BLE001 - any client failure degrades to a miss
            self._failed(exc)
            return [False] * len(keys)
        self._forget([k for k, h in zip(keys, held) if not h])
        return held

    def _forget(self, gone: Sequence[bytes]) -> None:
        """Keys the server answered it does not hold (expired, evicted, deleted): no longer
        known, so the next :meth:`submit` of one writes it again."""
        if gone:
            with self._lock:
                for key in gone:
                    self._known.pop(key, None)

    def tenant_counts(self) -> dict[str, int] | None:
        """Blocks per tenant label on the server (every worker's writes; one script call that
        first drops members written more than the tier's ``ttl`` ago whose block expired, so
        an expired block counts at most until the next call or quota trim); ``None`` without
        a quota or when the server cannot be reached (counted in ``errors``). Asked again
        within :data:`COUNTS_EVERY` seconds (every ``/metrics`` scrape asks, on the engine
        thread), it answers the last reading without a call."""
        if self.tenant_quota is None or not self.is_up:
            return None
        if self._last_counts is not None and self._clock() - self._last_counts[0] < COUNTS_EVERY:
            return dict(self._last_counts[1])
        now = time.time_ns() // 1000
        cutoff = now - self.ttl * 1_000_000 if self.ttl else -1
        try:
            got = self._counts(keys=[TENANTS], args=[TENANT_PREFIX, cutoff, now])
        except Exception as exc:  # noqa: BLE001 - stats degrade to "unknown"
            self._failed(exc)
            return None
        counts = {bytes(got[i]).decode(): int(got[i + 1]) for i in range(0, len(got), 2)}
        self._last_counts = (self._clock(), counts)
        return dict(counts)

    def clear(self) -> int | None:
        """Wait for queued writes, then delete every prefixkv block on the server (``pkv:*``,
        every model's and every worker's: the tier is shared); returns how many, or ``None``
        when the server could not be reached (counted in ``errors``)."""
        self._last_counts = None
        self._writer.flush()
        with self._lock:
            self._known.clear()
        deleted = 0
        try:
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=PREFIX + b"*", count=CLEAR_BATCH):
                batch.append(name)
                if len(batch) >= CLEAR_BATCH:
                    deleted += int(self._client.unlink(*batch))
                    batch = []
            if batch:
                deleted += int(self._client.unlink(*batch))
        except Exception as exc:  # noqa: BLE001 - reported to the caller as "not cleared"
            self._failed(exc)
            return None
        return deleted

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued writes; ``False`` on timeout."""
        return self._writer.flush(timeout)

    def close(self, *, wait: bool = True) -> None:
        """Finish queued writes, stop the writer thread, close the connections (``wait=False``:
        return at once; the thread still writes what is queued and the connections close with
        the tier's last reference)."""
        self._writer.close(wait=wait)
        if wait and not self._writer.running:
            self._bulk.close()
            self._client.close()

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    def _write(self, key: bytes, payload: bytes, tenant: str = DEFAULT_TENANT) -> None:
        if not self.is_up:
            self.counters.add(dropped=1)
            with self._lock:
                self._known.pop(key, None)
            return
        try:
            quota = -1 if self.tenant_quota is None else self.tenant_quota
            evicted = self._set(
                keys=[PREFIX + key, PIN_PREFIX + key, TENANT_PREFIX + tenant.encode(), TENANTS],
                args=[encode(key, self.layout, payload, self._secret), self.ttl,
                      time.time_ns() // 1000, quota, tenant])
        except BaseException:
            with self._lock:
                self._known.pop(key, None)
            raise
        self.counters.add(stored_blocks=1, stored_bytes=len(payload), evictions=int(evicted))

    def _delete(self, key: bytes) -> None:
        try:
            self._client.delete(PREFIX + key)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.counters.add(errors=1)
        with self._lock:
            was_up = self._clock() >= self._down_until
            self._down_until = self._clock() + self.retry_after
            if was_up:  # a server that went down may come back empty: publish again
                self._known.clear()
        if was_up:
            hint = ("; it wants a password: redis://[user]:password@host:port/db"
                    if any(w in str(exc).lower() for w in ("auth", "password")) else "")
            logger.warning("remote KV tier %s unavailable (%s%s); recomputing for %.1f s",
                           self.url, exc, hint, self.retry_after)


def redact(url: str) -> str:
    """``url`` with its password (in the authority or a ``password=`` parameter) replaced by
    ``***``; the rest kept."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = "&".join("password=***" if q.lower().startswith("password=") else q
                     for q in query.split("&")) if query else query
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def _call(job: Callable[[], None]) -> None:
    job()


def _pairs(keys: Sequence[bytes]) -> list[bytes]:
    """Block and pin-counter names, interleaved, as the pin scripts take them."""
    out: list[bytes] = []
    for k in keys:
        out += (PREFIX + k, PIN_PREFIX + k)
    return out
