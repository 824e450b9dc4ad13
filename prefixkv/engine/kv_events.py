"""KV cache events: vLLM's schema, its ``--kv-events-config``, and the engine's event sink.

A worker that publishes KV events tells subscribers (the ``precise`` router policy, llm-d,
Dynamo) exactly which blocks its prefix cache holds. The wire format is vLLM's
(``vllm/distributed/kv_events.py``): a :class:`KVEventBatch` ``(ts, events,
data_parallel_rank)`` of :class:`BlockStored` / :class:`BlockRemoved` / :class:`AllBlocksCleared`,
msgspec structs encoded as msgpack arrays with the event name as tag, sent on a ZMQ PUB socket as
three frames ``(topic, seq as 8 bytes big-endian, payload)`` (see
:mod:`prefixkv.engine.kv_events_zmq`).

**Block hashes.** A block's hash is :class:`~prefixkv.tiers.keys.BlockKeyer`'s chained sha256
(the lower tiers' process-independent key) with the fixed fingerprint :data:`EVENT_FINGERPRINT`,
cut to its last 8 bytes as an unsigned big-endian int (vLLM's integer form of its block hashes).
So the hash depends only on the block size, the request's namespace (``cache_salt``) and the
tokens from position 0 to the block's end: never on Python's hash seed, the process, or the
index kind (radix or hashed), and a router computes the same value from the prompt's tokens
(:func:`block_hashes`).

**Ownership and threads.** :class:`KVEventSink` is what the engine's
:class:`~prefixkv.engine.kv_manager.KVManager` calls, on the engine thread, where blocks change
state: ``stored`` after a commit indexed new blocks, ``removed`` after an eviction freed some,
``reset`` after a cache reset. Those calls only copy the ids and put a record on a bounded queue
(never blocking, never raising). The sink's thread owns everything else: the map from cached
block id to hash, hashing, batching (all records waiting at once go into one batch), encoding
and sending. When the queue is full a record is dropped and the thread then sends
:class:`AllBlocksCleared` and forgets its map: subscribers then know less than the worker holds
(they under-estimate, which is safe), never more.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import msgspec

from prefixkv.tiers.keys import BlockKeyer

__all__ = ["EVENT_FINGERPRINT", "AllBlocksCleared", "BlockRemoved", "BlockStored",
           "KVEventBatch", "KVEventSink", "KVEventsConfig", "block_hashes", "hash_int"]

logger = logging.getLogger(__name__)

EVENT_FINGERPRINT = "prefixkv/kv-events/v1"
"""The chain root's fingerprint: fixed, so any process can recompute a block's hash."""

MEDIUM_GPU = "GPU"  # vLLM's name for the device pool (prefixkv's pool, on CPU or GPU)


# ------------------------------------------------------------------ vLLM's schema
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events published at ``ts`` (seconds since the epoch)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (tagged with the class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Blocks entered the prefix cache: a chain continuing ``parent_block_hash`` (``None``: the
    chain starts at the prompt's first block); ``token_ids`` are the blocks' tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted or reset)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block left the prefix cache: forget everything known about this worker."""


class KVEventBatch(EventBatch):
    """What one message carries."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ------------------------------------------------------------------ config
@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (same JSON keys and defaults, ``ValueError`` on bad ones).

    ``endpoint``: the PUB socket; an address with ``*`` (any interface or, as the port, any free
    port), ``::``, ``ipc://`` or ``inproc://`` is bound, any other is connected to (a subscriber
    that binds). ``replay_endpoint``: an optional ROUTER socket (always bound) that re-sends the
    last ``buffer_steps`` batches from a sequence number on request.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be a bool")
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'null' or 'zmq', "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv_events_config.replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an int >= 1, got {value!r}")

    @property
    def enabled(self) -> bool:
        """Whether events are published (enabled, with a real publisher)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | KVEventsConfig) -> KVEventsConfig:
        """From the CLI's JSON text or a dict. As in vLLM, enabling events without naming a
        publisher means ``zmq``. Unknown keys are a ``ValueError`` naming them."""
        if isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
        data = dict(value)
        if data.get("enable_kv_cache_events") and "publisher" not in data:
            data["publisher"] = "zmq"
        return cls(**data)


# ------------------------------------------------------------------ hashes
def hash_int(digest: bytes) -> int:
    """A chained sha256 digest as an event hash: its last 8 bytes, unsigned big-endian."""
    return int.from_bytes(digest[-8:], "big")


def block_hashes(token_ids: Sequence[int], block_size: int,
                 namespace: Hashable | None = None) -> list[int]:
    """The event hashes of every full block of ``token_ids`` (what a worker publishes for
    them); ``ValueError`` for a bad block size or a namespace with no stable serialisation."""
    keyer = BlockKeyer(EVENT_FINGERPRINT, block_size)
    chain = keyer.extend([], token_ids, len(token_ids) // block_size, namespace)
    return [hash_int(d) for d in chain]


def _continue_chain(keyer: BlockKeyer, parent: bytes | None, token_ids: list[int],
                    namespace: Hashable | None) -> list[bytes]:
    """Digests of the full blocks of ``token_ids`` continuing the chain at ``parent`` (``None``:
    the namespace's root). ``BlockKeyer.extend`` starts after the chain it is given, so a
    placeholder block stands for everything up to ``parent``."""
    if parent is None:
        return keyer.extend([], token_ids, len(token_ids) // keyer.block_size, namespace)
    bs = keyer.block_size
    chain = keyer.extend([parent], [0] * bs + token_ids, 1 + len(token_ids) // bs, namespace)
    return chain[1:]


# ------------------------------------------------------------------ the sink
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
        self.published = 0
        self.dropped = 0
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
               token_ids: Sequence[int], namespace: Hashable | None) -> None:
        """``block_ids`` (holding ``token_ids``, whole blocks) are cached now, continuing the
        cached block ``parent_id`` (``None``: they start the prompt). Ids already known as
        cached (another sequence stored them first) are not announced again."""
        self._put(("stored", list(block_ids), parent_id, list(token_ids), namespace))

    def removed(self, block_ids: Sequence[int]) -> None:
        """``block_ids`` left the index (evicted); ids never announced are ignored."""
        if block_ids:
            self._put(("removed", list(block_ids)))

    def reset(self, block_ids: Sequence[int], num_cached_left: int) -> None:
        """A cache reset freed ``block_ids``; ``num_cached_left`` blocks (in use) stayed cached.
        Sends :class:`AllBlocksCleared` when nothing stayed, else :class:`BlockRemoved`."""
        self._put(("reset", list(block_ids), num_cached_left))

    def close(self, timeout: float = 1.0) -> None:
        """Flush (up to ``timeout`` seconds), stop the thread, close the publisher. Idempotent."""
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        self.publisher.close()

    # ---------------------------------------------------------- sink thread
    def _run(self) -> None:
        while True:
            try:
                self.publisher.service()
                first = self._queue.get(timeout=self._poll)
            except queue.Empty:
                continue
            except Exception:  # noqa: BLE001 - a replay error must not stop publishing
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
            except Exception:  # noqa: BLE001 - never let one bad batch stop the thread
                logger.exception("KV events: publishing a batch failed")
            if stop:
                return

    def _translate(self, records: list[tuple[Any, ...]]) -> list[Any]:
        events: list[Any] = []
        if self._overflow.is_set():
            self._overflow.clear()
            self._hashes.clear()
            events.append(AllBlocksCleared())
        for record in records:
            kind = record[0]
            if kind == "stored":
                events.extend(self._stored(*record[1:]))
            elif kind == "removed" or (kind == "reset" and record[2] > 0):
                gone = [self._hashes.pop(b) for b in record[1] if b in self._hashes]
                if gone:
                    events.append(BlockRemoved([hash_int(d) for d in gone], MEDIUM_GPU))
            elif kind == "reset":
                self._hashes.clear()
                events.append(AllBlocksCleared())
        return events

    def _stored(self, ids: list[int], parent_id: int | None, tokens: list[int],
                namespace: Hashable | None) -> list[BlockStored]:
        parent = None if parent_id is None else self._hashes.get(parent_id)
        if parent_id is not None and parent is None:
            return []  # its parent was never announced (after an overflow): stay silent
        try:
            digests = _continue_chain(self._keyer, parent, tokens, namespace)
        except ValueError:
            return []  # a namespace with no stable serialisation: not announced
        out: list[BlockStored] = []
        bs = self.block_size
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
                    tokens[start * bs : (run[-1] + 1) * bs], bs, None, MEDIUM_GPU))
                run = []
        return out
