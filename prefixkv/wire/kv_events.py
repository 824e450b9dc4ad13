"""KV cache events, the wire contract: vLLM's schema, its ``--kv-events-config``, block hashes.

A worker that publishes KV events tells subscribers (the ``precise`` router policy, llm-d,
Dynamo) exactly which blocks its prefix cache holds. The wire format is vLLM's
(``vllm/distributed/kv_events.py``): a :class:`KVEventBatch` ``(ts, events,
data_parallel_rank)`` of :class:`BlockStored` / :class:`BlockRemoved` / :class:`AllBlocksCleared`
sent on a ZMQ PUB socket as three frames ``(topic, seq as 8 bytes big-endian, payload)`` (see
:mod:`prefixkv.engine.kv_events_zmq`).

**Encodings.** vLLM 0.32 encodes the batch as a msgpack array and each event as a **map** with
a ``type`` tag (``{"type": "BlockStored", "block_hashes": ..., "lora_name": ..., ...}``): the
default here (``encoding: "map"``). Older vLLM, and SGLang, encode each event as an array
``[tag, field, ...]`` in field order (SGLang's ``BlockStored`` stops after ``lora_id``, its
``BlockRemoved`` after ``block_hashes``, its batch after ``ts, events[, attn_dp_rank]``);
``encoding: "array"`` publishes vLLM's old array layout. :func:`decode_batch` reads all of them,
per batch, with no setting.

**Block hashes.** A block's hash is :class:`~prefixkv.tiers.keys.BlockKeyer`'s chained sha256
(the lower tiers' process-independent key) with the fixed fingerprint :data:`EVENT_FINGERPRINT`,
cut to its last 8 bytes as an unsigned big-endian int (vLLM's integer form of its block hashes).
So the hash depends only on the block size, the request's namespace (:func:`request_salt`) and
the tokens from position 0 to the block's end: never on Python's hash seed, the process, or the
index kind (radix or hashed), and a router computes the same value from the prompt's tokens
(:func:`block_hashes`).

**Salted requests.** A block stored under a ``cache_salt`` / ``extra_key`` is published with its
hashes only (``token_ids`` empty, no ``extra_keys``): its hash chain has the salt folded in, so
a router that proxies the request (and so knows its salt) recomputes the hashes and matches
them, while any other subscriber learns neither the tokens nor the salt.

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

__all__ = ["DEFAULT_ENDPOINT", "ENCODINGS", "EVENT_FINGERPRINT", "MEDIUM_CPU", "MEDIUM_DISK", "MEDIUM_GPU", "AllBlocksCleared",
           "BlockRemoved", "BlockStored", "KVEvent", "KVEventBatch", "KVEventsConfig",
           "block_hashes", "continue_chain", "decode_batch", "encode_batch", "hash_int",
           "request_salt", "salted"]

EVENT_FINGERPRINT = "prefixkv/kv-events/v1"
"""The chain root's fingerprint: fixed, so any process can recompute a block's hash."""

MEDIUM_GPU = "GPU"  # vLLM's name for the device pool (prefixkv's pool, on CPU or GPU)
MEDIUM_CPU = "CPU"  # vLLM's offloading connector's name for host memory (prefixkv's host tier)
MEDIUM_DISK = "DISK"  # prefixkv's disk tier
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
"""Where events go when no endpoint is given: bound on loopback only (vLLM binds ``tcp://*:5557``,
every interface, which shows every tenant's prompts to the network)."""


# ------------------------------------------------------------------ vLLM's schema
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events published at ``ts`` (seconds since the epoch)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (a map tagged ``type`` = the class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Blocks entered the cache: a chain continuing ``parent_block_hash`` (``None``: the chain
    starts at the prompt's first block); ``token_ids`` are the blocks' tokens (empty for a
    salted request's blocks), ``medium`` the tier holding them (``None`` / ``"GPU"``: the device
    pool). Fields in vLLM's order; the defaulted ones are left off the wire when unset."""

    block_hashes: list[int | bytes]  # prefixkv sends ints; newer vLLM may send bytes
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # per block: what else vLLM hashed (mm, LoRA, salt)
    group_idx: int | None = None  # vLLM's KV cache group (hybrid models)
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache's ``medium`` (evicted or reset)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block left the prefix cache: forget everything known about this worker."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """What one message carries."""

    events: list[KVEvent]


ENCODINGS = ("map", "array")
_OPTIONAL = ("lora_id", "medium", "lora_name")  # required in vLLM's struct, absent in SGLang's
_FIELDS = {cls.__name__: cls.__struct_fields__ for cls in (BlockStored, BlockRemoved,
                                                             AllBlocksCleared)}
_ARRAY_FIELDS = {"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 0}
"""vLLM's old array layout: the fields each event carried before the map encoding."""


def encode_batch(batch: KVEventBatch, encoding: str = "map",
                 encoder: msgspec.msgpack.Encoder | None = None) -> bytes:
    """``batch`` as msgpack: events as tagged maps (``"map"``, vLLM 0.32) or as vLLM's old
    ``[tag, field, ...]`` arrays (``"array"``)."""
    enc = encoder or msgspec.msgpack.Encoder()
    if encoding == "map":
        return enc.encode(batch)
    if encoding != "array":
        raise ValueError(f"encoding must be one of {list(ENCODINGS)}, got {encoding!r}")
    events = [[type(e).__name__, *(getattr(e, f) for f in
                                   _FIELDS[type(e).__name__][:_ARRAY_FIELDS[type(e).__name__]])]
              for e in batch.events]
    return enc.encode([batch.ts, events, batch.data_parallel_rank])


_RAW = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch in any encoding the fleet speaks (see the module docstring), told apart per batch
    and per event; ``ValueError`` (naming what is wrong) for anything else. Unknown event fields
    are ignored; unknown event types are an error (the index would silently miss them)."""
    try:
        raw = _RAW.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):  # a map-encoded batch (newer vLLM)
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    elif isinstance(raw, list) and len(raw) in (2, 3):
        ts, events, rank = (*raw, None) if len(raw) == 2 else raw
    else:
        raise ValueError("a batch is [ts, events, rank?] or a map with ts and events")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise ValueError("a batch needs a numeric ts and a list of events")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise ValueError("a batch's rank must be an int or null")
    return KVEventBatch(float(ts), [_event(e, i) for i, e in enumerate(events)], rank)


def _event(raw: Any, i: int) -> KVEvent:
    """One event from its tagged map or ``[tag, field, ...]`` array."""
    tag: Any
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
        if tag not in _FIELDS:
            raise ValueError(f"event {i}: unknown type {tag!r}")
        data: dict[str, Any] = dict(zip(_FIELDS[tag], values))
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if tag not in _FIELDS:
            raise ValueError(f"event {i}: unknown type {tag!r}")
        data = dict(raw)
        data.pop("type")
    else:
        raise ValueError(f"event {i} is neither a tagged map nor a [tag, ...] array")
    for name in _OPTIONAL:
        if name in _FIELDS[tag]:
            data.setdefault(name, None)
    cls = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
           "AllBlocksCleared": AllBlocksCleared}[tag]
    try:
        event: KVEvent = msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"event {i} ({tag}): {exc}") from None
    return event


# ------------------------------------------------------------------ config
@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (same JSON keys and defaults, ``ValueError`` on bad ones).

    ``endpoint``: the PUB socket; not given (``None``): bound on :data:`DEFAULT_ENDPOINT`
    (loopback); otherwise vLLM's rule: an address with ``*`` (any interface, e.g.
    ``tcp://*:5557`` to expose it deliberately, or, as the port, any free port), ``::``,
    ``ipc://`` or ``inproc://`` is bound, any other is connected to (a subscriber that binds).
    ``replay_endpoint``: an optional ROUTER socket (always bound) that re-sends the last
    ``buffer_steps`` batches from a sequence number on request. ``encoding`` (prefixkv's key):
    ``"map"`` (vLLM 0.32's events, the default) or ``"array"`` (older consumers').
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "map"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be a bool")  # noqa: TRY004
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'null' or 'zmq', "
                             f"got {self.publisher!r}")
        if not isinstance(self.topic, str):
            raise ValueError("kv_events_config.topic must be a string")  # noqa: TRY004
        if self.endpoint is not None and not isinstance(self.endpoint, str):
            raise ValueError("kv_events_config.endpoint must be a string or null")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv_events_config.encoding must be one of {list(ENCODINGS)}, "
                             f"got {self.encoding!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv_events_config.replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an int >= 1, got {value!r}")

    @property
    def address(self) -> tuple[str, bool]:
        """The PUB address and whether it is bound (see the class docstring)."""
        ep = self.endpoint
        if ep is None:
            return DEFAULT_ENDPOINT, True
        return ep, ("*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")))

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


def salted(namespace: Hashable | None) -> bool:
    """Whether an engine namespace (``(cache_salt, lora)`` or ``None``) carries a cache salt: such
    blocks are published without their tokens (see the module docstring)."""
    return isinstance(namespace, tuple) and len(namespace) > 0 and namespace[0] is not None


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
