"""RemoteWatch: the Valkey blocks this worker wrote, and which of them the server dropped since.

It feeds the KV events of the shared tier (``medium`` ``SHARED_STORAGE``, see
:mod:`~prefixkv.integrations.vllm.events`); the worker runs one only when vLLM publishes events.

* **Stored.** :class:`~prefixkv.tiers.remote.RemoteTier` writes on its own thread, and only if
  the server lacks the key (``SET NX``; a write may also be dropped while the server is down).
  So a key this worker queued (:meth:`RemoteWatch.wrote`) is confirmed after the writer's queue
  drained, with one pipelined ``EXISTS`` per batch on the watch's own connection: a block is
  announced once the server holds it.
* **Dropped.** Valkey tells subscribers about expired, evicted and deleted keys when its
  ``notify-keyspace-events`` includes ``E`` (key-event channels) with ``x`` (expired), ``e``
  (evicted) and ``g`` (``DEL`` / ``UNLINK``: ``prefixkv cache reset --tiers remote``, quota
  trims, a corrupt record deleted). The watch adds whichever of those flags are missing with
  ``CONFIG SET`` (keeping the ones set; once per process), and subscribes to
  ``__keyevent@<db>__:expired`` / ``evicted`` / ``del`` on its own connection. A server that
  refuses ``CONFIG`` (a managed Valkey) gets one warning; the watch still subscribes (the
  operator may have set the flags) and otherwise learns of a drop only when a load finds the key
  missing (:meth:`RemoteWatch.missing`). After the subscription is lost (a restart, the network)
  the announced keys are checked again with ``EXISTS``: those gone meanwhile are dropped.

Only keys this worker announced are reported dropped, and it remembers the last :data:`KEPT`:
an older one is reported dropped when it is forgotten (the router then under-estimates what the
tier holds, never over-estimates).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from prefixkv.tiers.remote import PREFIX, RemoteTier

logger = logging.getLogger("vllm.prefixkv")
KEPT = 1 << 16
"""Announced keys remembered (their drops are reported)."""
FLAGS = "Exeg"
"""``notify-keyspace-events`` flags the watch needs: key-event channels for expired, evicted
and generic (``DEL`` / ``UNLINK``) events."""
EVENTS = ("expired", "evicted", "del")
CHECK_BATCH = 1024
"""Keys per pipelined ``EXISTS`` round trip."""
CONFIRM_TRIES = 20
"""Rounds a queued write may stay unconfirmed while the writer is still busy."""
RETRY_S = 2.0
"""Seconds between attempts to subscribe again."""


class RemoteWatch:
    """Confirms this worker's remote writes and collects the server's drops, on one thread."""

    def __init__(self, remote: RemoteTier, url: str, *, timeout: float = 0.5,
                 interval: float = 0.2, kept: int = KEPT) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        for ours, theirs in (("valkey://", "redis://"), ("valkeys://", "rediss://")):
            if url.startswith(ours):
                url = theirs + url[len(ours):]
        self.remote = remote
        self.interval = interval
        self.kept = kept
        self._client: Any = redis.Redis.from_url(  # no silent reconnects: a gap is rechecked
            url, socket_connect_timeout=timeout, socket_timeout=max(5.0, timeout),
            retry=Retry(NoBackoff(), 0))
        self._db = int(self._client.connection_pool.connection_kwargs.get("db", 0) or 0)
        self._lock = threading.Lock()
        self._pending: list[tuple[bytes, int]] = []  # (key, rounds unconfirmed)
        self._announced: OrderedDict[bytes, None] = OrderedDict()
        self._stored: list[bytes] = []
        self._dropped: list[bytes] = []
        self._configured = False
        self._warned_down = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefixkv-remote-watch",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers' side
    def wrote(self, keys: Iterable[bytes]) -> None:
        """``keys`` were queued for the remote tier by this worker (confirmed later)."""
        with self._lock:
            self._pending.extend((k, 0) for k in keys)

    def missing(self, keys: Iterable[bytes]) -> None:
        """A load found ``keys`` missing on a server that answered."""
        self._drop(keys)

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """(keys announced stored, keys announced dropped) since the last call, in order."""
        with self._lock:
            out = (self._stored, self._dropped)
            self._stored, self._dropped = [], []
            return out

    def close(self) -> None:
        """Stop the thread and close the connections."""
        self._stop.set()
        self._thread.join(10)
        self._client.close()

    # ------------------------------------------------------------------ bookkeeping
    def _announce(self, key: bytes) -> None:  # holds _lock
        if key in self._announced:
            self._announced.move_to_end(key)
            return
        self._announced[key] = None
        self._stored.append(key)
        while len(self._announced) > self.kept:
            self._dropped.append(self._announced.popitem(last=False)[0])

    def _drop(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                if key in self._announced:
                    del self._announced[key]
                    self._dropped.append(key)

    def _held(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether the server holds each key (None: it could not be asked)."""
        out: list[bool] = []
        try:
            for i in range(0, len(keys), CHECK_BATCH):
                pipe = self._client.pipeline(transaction=False)
                for key in keys[i : i + CHECK_BATCH]:
                    pipe.exists(PREFIX + key)
                out += [bool(n) for n in pipe.execute()]
        except Exception:  # noqa: BLE001 - unknown: decide on a later round
            return None
        return out

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        pubsub: Any = None
        next_try = 0.0
        while not self._stop.is_set():
            if pubsub is None and time.monotonic() >= next_try:
                pubsub = self._subscribe()
                next_try = time.monotonic() + RETRY_S
            if pubsub is None:
                self._stop.wait(self.interval)
            else:
                try:
                    self._receive(pubsub)
                except Exception as exc:  # noqa: BLE001 - lost: subscribe again, then recheck
                    logger.info("prefixkv: Valkey key-event subscription lost (%s); retrying",
                                exc)
                    pubsub.close()
                    pubsub = None
            self._confirm()
        if pubsub is not None:
            pubsub.close()

    def _subscribe(self) -> Any:
        """Subscribed key-event channels (then the announced keys rechecked), or None."""
        try:
            if not self._configured:
                self._configure()
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(*[f"__keyevent@{self._db}__:{e}" for e in EVENTS])
        except Exception as exc:  # noqa: BLE001 - the server is down: try again later
            if not self._warned_down:
                logger.info("prefixkv: cannot subscribe to Valkey key events yet (%s)", exc)
                self._warned_down = True
            return None
        self._warned_down = False
        with self._lock:
            known = list(self._announced)
        held = self._held(known) if known else []
        if held is not None:
            self._drop(k for k, there in zip(known, held) if not there)
        return pubsub

    def _configure(self) -> None:
        import redis

        try:
            got = self._client.config_get("notify-keyspace-events")
            value = next(iter(got.values()), "")
            current = value.decode() if isinstance(value, bytes) else str(value)
            missing = "".join(f for f in FLAGS if f not in current
                              and not (f in "xg" and "A" in current))
            if missing:
                self._client.config_set("notify-keyspace-events", current + missing)
        except redis.ResponseError as exc:  # refused (managed servers, ACLs): say so once
            logger.warning("prefixkv: Valkey refused CONFIG for notify-keyspace-events (%s): "
                           "blocks it expires, evicts or deletes are announced as removed only "
                           "if it already publishes key events (notify-keyspace-events %s), "
                           "else when a load finds them missing", exc, FLAGS)
        self._configured = True

    def _receive(self, pubsub: Any) -> None:
        msg = pubsub.get_message(timeout=self.interval)
        names: list[bytes] = []
        while msg is not None:
            if msg.get("type") == "message":
                data = msg["data"]
                names.append(data if isinstance(data, bytes) else str(data).encode())
            msg = pubsub.get_message(timeout=0.0)
        self._drop(n[len(PREFIX):] for n in names if n.startswith(PREFIX))

    def _confirm(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        drained = self.remote.flush(self.interval)
        held = self._held([k for k, _ in batch])
        retry: list[tuple[bytes, int]] = []
        with self._lock:
            for i, (key, tries) in enumerate(batch):
                if held is not None and held[i]:
                    self._announce(key)
                elif (held is None or not drained) and tries < CONFIRM_TRIES:
                    retry.append((key, tries + 1))
            self._pending[:0] = retry
