"""SharedDiskTier: prefixkv's ``DiskTier`` that also finds records written to its directory by
other processes after it started (other SGLang ranks or instances on one directory).

``DiskTier`` indexes its directory once, at start; afterwards it knows only what it wrote
itself. Under SGLang that is not enough: with a KV replicated across TP ranks (MLA) only one
rank writes a page and every rank reads it (the ranks' hit counts are reduced to their minimum),
and several instances may share a directory. So a key missing from the index is looked up on
disk, and a file whose header is a record of that key in this tier's layout (and MAC mode) is
indexed as the most recent; its payload is still checked on every read (a bad one is a miss).
Each instance bounds what it has indexed (``kv_disk_size``); a file another instance evicted
is a miss here (the read finds no file and forgets the key).
"""

from __future__ import annotations

from prefixkv.tiers.codec import header_size, is_record_of
from prefixkv.tiers.disk import DiskTier


class SharedDiskTier(DiskTier):
    """A disk tier whose directory other processes write to as well."""

    def contains(self, key: bytes) -> bool:
        """Whether a record of ``key`` is indexed, or is on disk and now indexed."""
        return super().contains(key) or self._adopt(key)

    def read(self, key: bytes) -> bytes | None:
        """The payload stored under ``key`` (indexed first if another process wrote it)."""
        if not super().contains(key):
            self._adopt(key)
        return super().read(key)

    def _adopt(self, key: bytes) -> bool:
        try:
            with open(self.path(key), "rb") as f:
                head = f.read(header_size(self.layout))
        except OSError:
            return False
        if not is_record_of(head, key, self.layout, self._secret is not None):
            return False
        with self._lock:
            self._index.setdefault(key, None)
        return True
