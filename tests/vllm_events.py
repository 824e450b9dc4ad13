"""vLLM's (and SGLang's) KV-event schema as a *consumer* declares it, for the tests.

Declared here independently of :mod:`prefixkv.wire.kv_events` (copied from how vLLM 0.32's
``vllm/distributed/kv_events.py`` and SGLang declare their msgspec structs), so a test that
decodes prefixkv's events with it, or encodes fixtures with it, checks the wire against the
peers' definitions rather than against our own. Used by the engine's and the router's tests.
"""

from __future__ import annotations

from typing import Any

import msgspec


# ---------------------------------------------------------------- vLLM 0.32: map events
class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch: an array ``(ts, events, data_parallel_rank)``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VMapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """Newer vLLM: the batch too is a map."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VStored(VEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VBatch):
    events: list[VStored | VRemoved | VCleared]


DECODER = msgspec.msgpack.Decoder(VKVEventBatch)
"""Decodes a vLLM 0.32 batch (map events)."""


# ---------------------------------------------------------------- older vLLM: array events
class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(VBatch):
    events: list[OldStored | OldRemoved | OldCleared]


OLD_DECODER = msgspec.msgpack.Decoder(OldBatch)
"""Decodes an older vLLM batch (array events)."""


# ---------------------------------------------------------------- SGLang: arrays, fewer fields
class SgStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class SgRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class SgCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class SgBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
