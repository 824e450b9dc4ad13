"""PinRegistry: the pinned prefixes of one index, keyed by everything that names a prefix.

A pin is keyed by ``(namespace, extra keys of its blocks, its block-aligned tokens)``, so two
prefixes with the same tokens but different extra keys (multimodal hashes) are two pins. Each
record keeps the entry its pin counts were added to (the deepest entry of the prefix); the
driver adds and removes those counts (:class:`~prefixkv.cache.protection.Protection`), the
registry only remembers them. Guarded by the index's lock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, TypeVar

from prefixkv.cache.protocol import Namespace, PinnedPrefix

T = TypeVar("T")

PinKey = tuple[Namespace, tuple[Hashable | None, ...] | None, tuple[int, ...]]


def pin_key(namespace: Namespace, extra_keys: Sequence[Hashable | None] | None,
            tokens: Sequence[int], num_blocks: int, block_size: int) -> PinKey:
    """The registry key of the first ``num_blocks`` blocks of ``tokens``."""
    extra = None if extra_keys is None else tuple(extra_keys[:num_blocks])
    return (namespace, extra, tuple(tokens[: num_blocks * block_size]))


class PinRegistry(Generic[T]):
    """Pinned prefixes (oldest first) and the entry each one pinned."""

    __slots__ = ("_pins",)

    def __init__(self) -> None:
        self._pins: dict[PinKey, tuple[PinnedPrefix, T]] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, key: PinKey) -> PinnedPrefix | None:
        """The record pinned under ``key``, if any."""
        got = self._pins.get(key)
        return None if got is None else got[0]

    def add(self, key: PinKey, target: T, num_blocks: int, description: str | None,
            now: float) -> PinnedPrefix:
        """Record a new pin of ``target`` (``num_blocks`` deep) under ``key``; returns its record."""
        namespace, extra, tokens = key
        info = PinnedPrefix(token_ids=list(tokens), num_blocks=num_blocks,
                            namespace=namespace, description=description, pinned_at=now,
                            extra_keys=None if extra is None else list(extra))
        self._pins[key] = (info, target)
        return info

    def pop(self, key: PinKey) -> T | None:
        """Forget the pin under ``key``; returns the entry it pinned (``None``: not pinned)."""
        got = self._pins.pop(key, None)
        return None if got is None else got[1]

    def clear(self) -> list[T]:
        """Forget every pin; returns the entries they pinned."""
        targets = [target for _, target in self._pins.values()]
        self._pins.clear()
        return targets

    def records(self) -> list[PinnedPrefix]:
        """The records, oldest first."""
        return [info for info, _ in self._pins.values()]

    def __iter__(self) -> Iterator[T]:
        return (target for _, target in self._pins.values())

