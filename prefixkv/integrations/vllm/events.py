"""TierEvents: what the connector's lower tiers gained and lost, for vLLM's KV-event publisher.

vLLM publishes the scheduler's ``take_events()`` with its own block pool's events
(``--kv-events-config``), so a router that reads vLLM's stream also sees the connector's tiers:
``BlockStored`` / ``BlockRemoved`` with ``medium`` ``"CPU"`` (the host tier, vLLM's name for
CPU offloading), ``"DISK"`` (the disk tier, prefixkv's engine's name) or ``"SHARED_STORAGE"``
(the Valkey tier: the name llm-d's file-system backend gives the storage its vLLM instances
share; prefixkv's router reads any medium it does not know as its ``remote`` tier). Sources,
all in the scheduler process:

* host: a save planned into an arena slot is stored (its copy finishes before any load reads
  the slot); a key the host index evicts or clears is removed;
* disk: the worker reports the keys its disk tier wrote and dropped (evicted, cleared, found
  corrupt) through vLLM's worker metadata, one step later;
* Valkey: the worker reports the keys it wrote that the server then held, and which of those
  the server expired, evicted or deleted (keyspace notifications) or a load found missing
  (:mod:`~prefixkv.integrations.vllm.remote_watch`), the same way. A block another instance
  wrote is announced by that instance only.

An event needs the block's facts as vLLM states
them (its block hash, parent hash, tokens, LoRA, extra keys), captured from the request when its
save is planned and kept for the last :data:`FACTS_KEPT` keys: a key whose facts are gone (or a
block stored by an earlier process) is not announced, so a router under-estimates, never more.
Pure Python: the connector turns these records into vLLM's event classes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

HOST_MEDIUM = "CPU"
DISK_MEDIUM = "DISK"
REMOTE_MEDIUM = "SHARED_STORAGE"
FACTS_KEPT = 1 << 16
"""Keys whose block facts are remembered (LRU), ~200 bytes each plus the block's token ids."""


@dataclass(frozen=True, slots=True)
class BlockFacts:
    """What a ``BlockStored`` event says about one block (vLLM's values)."""

    block_hash: Any
    parent_hash: Any
    token_ids: tuple[int, ...]
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: Any = None


@dataclass(frozen=True, slots=True)
class TierEvent:
    """``key`` entered (``stored``) or left the tier ``medium``; ``facts`` as vLLM knows it."""

    stored: bool
    medium: str
    key: bytes
    facts: BlockFacts


Describe = Callable[[Any, int], BlockFacts | None]
"""``describe(request, j)``: the facts of the request's ``j``-th block (None: not known)."""


class TierEvents:
    """Collects tier changes between two ``take`` calls (engine-core thread only)."""

    def __init__(self, describe: Describe, facts_kept: int = FACTS_KEPT) -> None:
        self.describe = describe
        self.facts_kept = facts_kept
        self._facts: OrderedDict[bytes, BlockFacts] = OrderedDict()
        self._events: list[TierEvent] = []

    def learn(self, request: Any, j: int, key: bytes) -> None:
        """Remember the facts of ``request``'s ``j``-th block, stored under ``key``."""
        if key in self._facts:
            self._facts.move_to_end(key)
            return
        facts = self.describe(request, j)
        if facts is None:
            return
        self._facts[key] = facts
        while len(self._facts) > self.facts_kept:
            self._facts.popitem(last=False)

    def change(self, stored: bool, medium: str, keys: Iterable[bytes]) -> None:
        """``keys`` entered (``stored``) or left ``medium``; keys without facts are skipped."""
        for key in keys:
            facts = self._facts.get(key)
            if facts is not None:
                self._events.append(TierEvent(stored, medium, key, facts))

    def take(self) -> list[TierEvent]:
        """The events since the last call, in order."""
        out, self._events = self._events, []
        return out
