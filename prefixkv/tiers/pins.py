"""PinnedKeys: the tier keys of pinned prefixes, which no lower tier may evict.

A pin lives in the prefix index (the pool keeps a pinned prefix's blocks until it is unpinned
or the cache is reset). The tiers below keep their copies of those blocks too: the host and
disk tiers skip pinned keys when they choose what to evict, so a pinned prefix is never
dropped from the lowest local tier that holds it (a new block that would need a pinned one
evicted is not stored there instead). Keys are counted: two pinned prefixes share their
common leading blocks, and unpinning one keeps the other's blocks pinned.

Pins are the engine's state, not the tiers': they are not written to disk (a restarted engine
starts with no pins) nor to the remote tier (the remote server evicts by its own policy; see
docs/tiers.md). Thread safe: the disk writer thread asks while the engine thread pins.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class PinnedKeys:
    """A counted set of pinned tier keys."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[bytes] = Counter()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._counts

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)

    def add(self, keys: Iterable[bytes]) -> None:
        """Pin ``keys`` once more each."""
        with self._lock:
            self._counts.update(keys)

    def remove(self, keys: Iterable[bytes]) -> None:
        """Undo one :meth:`add` of ``keys`` (keys not pinned are ignored)."""
        with self._lock:
            for k in keys:
                n = self._counts.get(k, 0) - 1
                if n > 0:
                    self._counts[k] = n
                else:
                    self._counts.pop(k, None)

    def clear(self) -> None:
        """Unpin everything (a cache reset)."""
        with self._lock:
            self._counts.clear()

    def snapshot(self) -> frozenset[bytes]:
        """The pinned keys now."""
        with self._lock:
            return frozenset(self._counts)
