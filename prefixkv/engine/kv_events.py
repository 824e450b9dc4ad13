"""The engine's KV event sink: records block state changes, publishes them off the engine loop.

**Ownership and threads.** :class:`KVEventSink` is what the engine's
:class:`~prefixkv.engine.kv_manager.KVManager` calls, on the engine thread, where blocks change
state: ``stored`` after a commit indexed new blocks, ``removed`` after an eviction freed some,
``reset`` after a cache reset. Those calls only copy the ids and put a record on a bounded queue
(never blocking, never raising). The sink's thread owns everything else: the map from cached
block id to hash (:mod:`prefixkv.wire.kv_events`: the schema and the hashes), hashing, batching (all
records waiting at once go into one batch), encoding and sending. When the queue is full a
record is dropped and the thread then sends :class:`AllBlocksCleared` and forgets its map:
subscribers then know less than the worker holds (they under-estimate, which is safe), never
more.

**Tiers.** A block evicted from the pool that the host tier kept is announced again as stored
with ``medium`` ``"CPU"`` (vLLM's offloading connector's name; hashes only), and a host-tier key
that is evicted or cleared as removed from ``"CPU"`` (:meth:`KVEventSink.host_dropped`, the host
tier's hook). A block the disk tier's writer wrote is stored on ``"DISK"``, one it evicted,
cleared or found corrupt removed from it (:meth:`KVEventSink.disk_stored` / ``disk_dropped``,
called from the writer thread; the block's tier key is mapped to its hash when the pool stored
it, for the last :data:`KEYED` blocks). The remote tier is not announced: it is shared and
evicted by its server, which tells no one.

**Tenants.** A salted request's blocks (``cache_salt`` / ``extra_key``) go out with their hashes
only: ``token_ids`` empty (see :mod:`prefixkv.wire.kv_events`, "Salted requests"). Their prompts
never leave the worker; the router re-hashes the prompt it proxies with its salt.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

from prefixkv.engine.lora import lora_name
from prefixkv.wire.kv_events import (
    EVENT_FINGERPRINT,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    continue_chain,
    hash_int,
    salted,
)
from prefixkv.tiers.keys import BlockKeyer

__all__ = ["BatchPublisher", "KVEventSink"]

logger = logging.getLogger(__name__)


class BatchPublisher(Protocol):
    """Where the sink's thread sends each batch (the ZMQ publisher): its bound ``endpoint``,
    ``replay_endpoint`` (``None``: no replay) and ``topic`` are what subscribers connect to."""

    endpoint: str
    replay_endpoint: str | None
    topic: str

    def send(self, batch: KVEventBatch) -> None:
        """Encode and send one batch (called on the sink's thread only)."""
        ...

    def service(self) -> None:
        """Answer waiting replay requests, if any (called on the sink's thread only)."""
        ...

    def close(self) -> None:
        """Release the sockets (after the thread stopped)."""
        ...


_STOP = ("stop",)
KEYED = 65_536
"""Recently stored blocks whose tier key the sink remembers, to announce their disk write."""


class KVEventSink:
    """Records block state changes on the engine thread; publishes them from its own thread.

    ``stored`` / ``removed`` / ``reset`` never block and never raise (a full queue drops the
    record: see the module docstring). :meth:`close` flushes what is queued (up to a second),
    then stops the thread and the publisher. ``published`` counts the batches sent.
    """

    def __init__(self, block_size: int, publisher: BatchPublisher, *,
                 max_queue_size: int = 100_000, data_parallel_rank: int = 0,
                 poll_interval: float = 0.05) -> None:
        self.block_size = block_size
        self._keyer = BlockKeyer(EVENT_FINGERPRINT, block_size)
        self.publisher = publisher
        self._rank = data_parallel_rank
        self._poll = poll_interval
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=max_queue_size)
        self._overflow = threading.Event()
        self._hashes: dict[int, bytes] = {}  # cached block id -> digest (thread-owned)
        self._host: dict[bytes, bytes] = {}  # host tier key -> digest (thread-owned)
        self._disk: dict[bytes, bytes] = {}  # announced disk tier key -> digest (thread-owned)
        self._keyed: OrderedDict[bytes, bytes] = OrderedDict()  # recent tier key -> digest
        self.published = 0
        self.dropped = 0
        self._stopping = threading.Event()
        self._publisher_closed = False
        self._thread = threading.Thread(target=self._run, name="prefixkv-kv-events", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- engine thread
    def _put(self, record: tuple[Any, ...]) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            self._overflow.set()

    def stored(self, block_ids: Sequence[int], parent_id: int | None,
               token_ids: Sequence[int], namespace: Hashable | None,
               tier_keys: Sequence[bytes] = ()) -> None:
        """``block_ids`` (holding ``token_ids``, whole blocks) are cached now, continuing the
        cached block ``parent_id`` (``None``: they start the prompt). Ids already known as
        cached (another sequence stored them first) are not announced again. ``tier_keys``:
        the blocks' lower-tier keys, one per block (empty without tiers)."""
        self._put(("stored", list(block_ids), parent_id, list(token_ids), namespace,
                   list(tier_keys)))

    def removed(self, block_ids: Sequence[int],
                to_host: Sequence[tuple[int, bytes]] = ()) -> None:
        """``block_ids`` left the index (evicted); ids never announced are ignored. ``to_host``:
        the ``(block id, host tier key)`` pairs of them the host tier now holds."""
        if block_ids:
            self._put(("removed", list(block_ids), list(to_host)))

    def disk_stored(self, keys: list[bytes]) -> None:
        """The disk tier wrote ``keys`` (its hook, on its writer thread)."""
        if keys:
            self._put(("disk_stored", list(keys)))

    def disk_dropped(self, keys: list[bytes]) -> None:
        """The disk tier evicted, cleared or lost ``keys`` (its hook, any thread)."""
        if keys:
            self._put(("disk_dropped", list(keys)))

    def host_dropped(self, keys: list[bytes]) -> None:
        """The host tier evicted or cleared ``keys`` (its hook; keys never announced are
        ignored)."""
        if keys:
            self._put(("host_dropped", list(keys)))

    def reset(self, block_ids: Sequence[int], num_cached_left: int) -> None:
        """A cache reset freed ``block_ids``; ``num_cached_left`` blocks (in use) stayed cached.
        Sends :class:`AllBlocksCleared` when nothing stayed, else :class:`BlockRemoved`."""
        self._put(("reset", list(block_ids), num_cached_left))

    def close(self, timeout: float = 1.0, *, wait: bool = True) -> None:
        """Flush (up to ``timeout`` seconds), stop the thread, close the publisher (the thread
        closes it as it ends). ``wait=False``: return at once, the thread flushes and ends on
        its own (a dropped engine's finalizer). Idempotent."""
        self._stopping.set()
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout if wait else 0)
            except queue.Full:
                pass  # the thread stops once the queue is empty
            if not wait or self._thread is threading.current_thread():
                return
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_publisher()

    def _close_publisher(self) -> None:
        if not self._publisher_closed:
            self._publisher_closed = True
            self.publisher.close()

    # ---------------------------------------------------------- sink thread
    def _run(self) -> None:
        try:
            self._publish()
        finally:
            self._close_publisher()  # the sockets are this thread's: closed here, after the last

    def _publish(self) -> None:
        while True:
            try:
                self.publisher.service()
                first = self._queue.get(timeout=self._poll)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            except Exception:
                logger.exception("KV events: replay failed")
                continue
            records = [first]
            while len(records) < 4096:
                try:
                    records.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in records
            try:
                events = self._translate([r for r in records if r is not _STOP])
                if events:
                    self.publisher.send(KVEventBatch(time.time(), events, self._rank))
                    self.published += 1
            except Exception:
                logger.exception("KV events: publishing a batch failed")
            if stop:
                return

    def _translate(self, records: list[tuple[Any, ...]]) -> list[Any]:
        events: list[Any] = []
        if self._overflow.is_set():
            self._overflow.clear()
            self._hashes.clear()
            self._host.clear()
            self._disk.clear()
            events.append(AllBlocksCleared())
        bs = self.block_size
        for record in records:
            kind = record[0]
            if kind == "stored":
                events.extend(self._stored(*record[1:5]))
                self._remember(record[1], record[5])
            elif kind in ("disk_stored", "disk_dropped"):
                events.extend(self._disk_event(kind == "disk_stored", record[1]))
            elif kind == "removed":
                kept = [(k, self._hashes[b]) for b, k in record[2] if b in self._hashes]
                if kept:
                    self._host.update(kept)
                    events.append(BlockStored([hash_int(d) for _, d in kept], None, [], bs,
                                              None, MEDIUM_CPU, None))
                gone = [self._hashes.pop(b) for b in record[1] if b in self._hashes]
                if gone:
                    events.append(BlockRemoved([hash_int(d) for d in gone], MEDIUM_GPU))
            elif kind == "host_dropped":
                left = [self._host.pop(k) for k in record[1] if k in self._host]
                if left:
                    events.append(BlockRemoved([hash_int(d) for d in left], MEDIUM_CPU))
            elif kind == "reset" and record[2] > 0:
                gone = [self._hashes.pop(b) for b in record[1] if b in self._hashes]
                if gone:
                    events.append(BlockRemoved([hash_int(d) for d in gone], MEDIUM_GPU))
            elif kind == "reset":  # (subscribers forget every tier: the tier maps too)
                self._hashes.clear()
                self._host.clear()
                self._disk.clear()
                events.append(AllBlocksCleared())
        return events

    def _remember(self, ids: list[int], keys: list[bytes]) -> None:
        """Map the tier keys of just-stored blocks to their digests (the last :data:`KEYED`)."""
        for block, key in zip(ids, keys):
            digest = self._hashes.get(block)
            if digest is not None:
                self._keyed[key] = digest
                self._keyed.move_to_end(key)
        while len(self._keyed) > KEYED:
            self._keyed.popitem(last=False)

    def _disk_event(self, stored: bool, keys: list[bytes]) -> list[Any]:
        """``BlockStored`` / ``BlockRemoved`` on ``"DISK"`` for the keys it can name."""
        if stored:
            new = [(k, self._keyed[k]) for k in keys if k in self._keyed and k not in self._disk]
            self._disk.update(new)
            digests = [d for _, d in new]
        else:
            digests = [self._disk.pop(k) for k in keys if k in self._disk]
        if not digests:
            return []
        hashes: list[int | bytes] = [hash_int(d) for d in digests]
        if stored:
            return [BlockStored(hashes, None, [], self.block_size, None, MEDIUM_DISK, None)]
        return [BlockRemoved(hashes, MEDIUM_DISK)]

    def _stored(self, ids: list[int], parent_id: int | None, tokens: list[int],
                namespace: Hashable | None) -> list[BlockStored]:
        parent = None if parent_id is None else self._hashes.get(parent_id)
        if parent_id is not None and parent is None:
            return []  # its parent was never announced (after an overflow): stay silent
        try:
            digests = continue_chain(self._keyer, parent, tokens, namespace)
        except ValueError:
            return []  # a namespace with no stable serialisation: not announced
        out: list[BlockStored] = []
        bs = self.block_size
        hidden = salted(namespace)  # the tenant's tokens stay here: hashes only
        run: list[int] = []  # positions of a run of newly cached blocks
        for i, (block, digest) in enumerate(zip(ids, digests)):
            if block not in self._hashes:
                self._hashes[block] = digest
                run.append(i)
            if run and (block in self._hashes and run[-1] != i or i == len(ids) - 1):
                start = run[0]
                prev = parent if start == 0 else digests[start - 1]
                out.append(BlockStored(
                    [hash_int(digests[j]) for j in run],
                    None if prev is None else hash_int(prev),
                    [] if hidden else tokens[start * bs : (run[-1] + 1) * bs], bs, None,
                    MEDIUM_GPU, lora_name(namespace)))
                run = []
        return out
