"""PinRegistry: the pinned prefixes of one index, keyed by everything that names a prefix.

A pin is keyed by ``(namespace, extra keys of its blocks, its block-aligned tokens)``, so two
prefixes with the same tokens but different extra keys (multimodal hashes) are two pins. Each
record keeps the entry its pin counts were added to (the deepest entry of the prefix, which a
split never moves), so unpinning removes exactly what pinning added. The budget is checked
before anything changes. Guarded by the index's lock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from prefixkv.cache.protection import Protection
from prefixkv.cache.protocol import Namespace, PinError, PinnedPrefix

if TYPE_CHECKING:
    from prefixkv.cache.forest import Entry

E = TypeVar("E", bound="Entry")

PinKey = tuple[Namespace, tuple[Hashable | None, ...] | None, tuple[int, ...]]


def pin_key(namespace: Namespace, extra_keys: Sequence[Hashable | None] | None,
            tokens: Sequence[int], num_blocks: int, block_size: int) -> PinKey:
    """The registry key of the first ``num_blocks`` blocks of ``tokens``."""
    extra = None if extra_keys is None else tuple(extra_keys[:num_blocks])
    return (namespace, extra, tuple(tokens[: num_blocks * block_size]))


class PinRegistry(Generic[E]):
    """Pinned prefixes (oldest first), the entry each one pinned, and the pinned-block budget.

    Args:
        prot: the index's protection counts (a pin adds ``pin_ref`` along its path).
        budget: at most this many blocks pinned at once (``max_pinned_blocks``).
    """

    __slots__ = ("_pins", "_prot", "budget")

    def __init__(self, prot: Protection, budget: int) -> None:
        self._pins: dict[PinKey, tuple[PinnedPrefix, E]] = {}
        self._prot = prot
        self.budget = budget

    def get(self, key: PinKey) -> PinnedPrefix | None:
        """The record pinned under ``key``, if any."""
        got = self._pins.get(key)
        return None if got is None else got[0]

    def pin(self, key: PinKey, target: E, num_blocks: int, description: str | None,
            now: float) -> PinnedPrefix:
        """Pin ``target`` (the deepest entry of a ``num_blocks``-block prefix) under ``key``;
        :class:`PinError` if that would exceed the budget (nothing changes then)."""
        new = self._prot.new_pinned_blocks(target)
        pinned = self._prot.pinned_blocks
        if pinned + new > self.budget:
            raise PinError(
                f"pinning {new} more blocks would exceed max_pinned_blocks={self.budget} "
                f"({pinned} pinned)"
            )
        self._prot.add_pin(target, +1)
        namespace, extra, tokens = key
        info = PinnedPrefix(token_ids=list(tokens), num_blocks=num_blocks, namespace=namespace,
                            description=description, pinned_at=now,
                            extra_keys=None if extra is None else list(extra))
        self._pins[key] = (info, target)
        return info

    def unpin(self, key: PinKey) -> bool:
        """Remove the pin under ``key``; ``False`` if there was none."""
        got = self._pins.pop(key, None)
        if got is None:
            return False
        self._prot.add_pin(got[1], -1)
        return True

    def unpin_all(self) -> None:
        """Remove every pin."""
        for _, target in self._pins.values():
            self._prot.add_pin(target, -1)
        self._pins.clear()

    def records(self) -> list[PinnedPrefix]:
        """The records, oldest first."""
        return [info for info, _ in self._pins.values()]
