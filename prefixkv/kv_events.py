"""KV cache events, the wire contract: vLLM's schema, its ``--kv-events-config``, block hashes.

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
So the hash depends only on the block size, the request's namespace (:func:`request_salt`) and
the tokens from position 0 to the block's end: never on Python's hash seed, the process, or the
index kind (radix or hashed), and a router computes the same value from the prompt's tokens
(:func:`block_hashes`).

Torch-free (the router imports it): the worker side is :mod:`prefixkv.engine.kv_events` (the
engine's sink) and :mod:`prefixkv.engine.kv_events_zmq` (the transport), the router side
:mod:`prefixkv.router.kv_index` and :mod:`prefixkv.router.kv_stream`.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from prefixkv.tiers.keys import BlockKeyer

__all__ = ["EVENT_FINGERPRINT", "MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored",
           "KVEventBatch", "KVEventsConfig", "block_hashes", "continue_chain", "hash_int",
           "request_salt"]

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

    block_hashes: list[int | bytes]  # prefixkv sends ints; newer vLLM may send bytes
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted or reset)."""

    block_hashes: list[int | bytes]
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
            raise ValueError("kv_events_config.enable_kv_cache_events must be a bool")  # noqa: TRY004
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'null' or 'zmq', "
                             f"got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")  # noqa: TRY004
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
            raise ValueError("kv_events_config must be a JSON object")  # noqa: TRY004
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
        data = dict(value)
        if data.get("enable_kv_cache_events") and "publisher" not in data:
            data["publisher"] = "zmq"
        return cls(**data)


# ------------------------------------------------------------------ hashes
def request_salt(cache_salt: str | None, extra_key: str | None = None) -> str | None:
    """The cache salt a request's blocks live under: its ``cache_salt`` (vLLM's), or with SGLang's
    ``extra_key`` both as one JSON string, so requests with different keys never share cached KV
    (SGLang isolates its radix tree by them) and a keyed salt never equals a bare one. Workers
    (the server) and the router (to re-hash a prompt) both derive it here."""
    return cache_salt if extra_key is None else json.dumps(["extra_key", extra_key, cache_salt])


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


def continue_chain(keyer: BlockKeyer, parent: bytes | None, token_ids: list[int],
                    namespace: Hashable | None) -> list[bytes]:
    """Digests of the full blocks of ``token_ids`` continuing the chain at ``parent`` (``None``:
    the namespace's root). ``BlockKeyer.extend`` starts after the chain it is given, so a
    placeholder block stands for everything up to ``parent``."""
    if parent is None:
        return keyer.extend([], token_ids, len(token_ids) // keyer.block_size, namespace)
    bs = keyer.block_size
    chain = keyer.extend([parent], [0] * bs + token_ids, 1 + len(token_ids) // bs, namespace)
    return chain[1:]
