"""Pinned keys on the lower tiers: the host and disk tiers never evict them; ``clear`` keeps
them; counts survive shared blocks (two pins, one unpinned)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.host import HostTier
from prefixkv.tiers.pins import PinnedKeys


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_counted_pins() -> None:
    p = PinnedKeys()
    p.add([b"a", b"b"])
    p.add([b"a"])  # a second pin sharing block a
    p.remove([b"a", b"b"])
    assert b"a" in p and b"b" not in p and len(p) == 1
    p.remove([b"a", b"zz"])  # unknown keys are ignored
    assert len(p) == 0
    p.add([b"c"])
    p.clear()
    assert p.snapshot() == frozenset()


def test_host_eviction_skips_pinned_keys() -> None:
    pins = PinnedKeys()
    h = HostTier(2, pins)
    h.reserve(b"a")
    h.reserve(b"b")
    pins.add([b"a"])  # a is the least recently used, but pinned
    assert h.reserve(b"c") is not None and b"a" in h and b"b" not in h
    pins.add([b"c"])
    assert h.reserve(b"d") is None and h.counters.get("dropped") == 1  # only pinned keys left
    assert h.clear() == 0 and len(h) == 2  # clear keeps pinned keys too
    pins.remove([b"a"])
    assert h.reserve(b"d") is not None and b"a" not in h and b"c" in h
    assert h.clear() == 1 and h.stored_keys() == [b"c"]


def test_disk_eviction_skips_pinned_keys(tmp_path: Path) -> None:
    pins = PinnedKeys()
    d = DiskTier(tmp_path, 2, "uint8:4", 4, pins)
    for i in range(2):
        d.submit(key(i), bytes([i]) * 4)
        assert d.flush()
    pins.add([key(0)])  # the oldest file, pinned
    d.submit(key(2), b"\x02" * 4)
    assert d.flush()
    assert d.stored_keys() == [key(0), key(2)] and not d.path(key(1)).exists()
    pins.add([key(2)])
    d.submit(key(3), b"\x03" * 4)  # no unpinned file to make room: the new block is not kept
    assert d.flush()
    assert d.stored_keys() == [key(0), key(2)] and not d.path(key(3)).exists()
    assert d.counters.get("dropped") == 1 and d.counters.get("evictions") == 1
    assert d.read(key(0)) == b"\x00" * 4
    pins.remove([key(2)])
    assert d.clear() == 1 and d.stored_keys() == [key(0)] and len(list(tmp_path.glob("*.kvb"))) == 1
    d.close()
