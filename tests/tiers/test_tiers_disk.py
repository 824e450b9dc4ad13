from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from prefixkv.tiers.disk import DiskTier

LAYOUT = "uint8:16"


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 16


def test_write_read_reindex_and_capacity(tmp_path: Path) -> None:
    d = DiskTier(tmp_path, 3, LAYOUT, 16)
    for i in range(4):
        d.submit(key(i), payload(i))
        assert d.flush()
    d.submit(key(3), payload(3))  # already there: skipped
    assert d.flush()
    assert len(d) == 3 and not d.contains(key(0))  # the oldest went for room
    assert d.counters.get("evictions") == 1 and d.counters.get("stored_blocks") == 4
    assert d.read(key(1)) == payload(1)  # touches 1: now most recent
    assert d.read(key(0)) is None
    d.close()
    (tmp_path / "junk.kvb.123.tmp").write_bytes(b"half")
    again = DiskTier(tmp_path, 2, LAYOUT, 16)  # restart, smaller: the least recent goes
    assert len(again) == 2 and again.read(key(1)) == payload(1) and again.read(key(3)) == payload(3)
    assert not again.contains(key(2)) and not (tmp_path / "junk.kvb.123.tmp").exists()
    assert len(list(tmp_path.glob("*.kvb"))) == 2
    again.close()


def test_a_full_tier_drops_a_chains_tail_before_its_head(tmp_path: Path) -> None:
    """Chains are touched head first: under pressure a prompt keeps its leading blocks (which
    stay reachable) rather than its tail; a chain read again moves ahead of a newer one."""
    d = DiskTier(tmp_path, 6, LAYOUT, 16)
    a = [key(i) for i in range(4)]
    b = [key(10 + i) for i in range(4)]
    for k in a:
        d.submit(k, payload(0))
    d.touch(a)
    assert d.flush() and d.stored_keys() == a[::-1]
    for k in b:
        d.submit(k, payload(1))
    d.touch(b)
    assert d.flush()
    assert set(d.stored_keys()) == {*a[:2], *b}  # a's tail went first, its head is left
    d.touch(a[:2])  # a read again: now b is the older chain
    c = [key(20 + i) for i in range(2)]
    for k in c:
        d.submit(k, payload(2))
    d.touch(c)
    assert d.flush()
    assert set(d.stored_keys()) == {*a[:2], *b[:2], *c}
    assert d.counters.get("evictions") == 4
    d.close()


def test_corrupt_and_missing_files_are_misses(tmp_path: Path) -> None:
    d = DiskTier(tmp_path, 8, LAYOUT, 16)
    for i in range(3):
        d.submit(key(i), payload(i))
    assert d.flush()
    d.path(key(0)).write_bytes(d.path(key(0)).read_bytes()[:-3])
    d.path(key(1)).unlink()
    assert d.read(key(0)) is None and not d.path(key(0)).exists()
    assert d.read(key(1)) is None and not d.contains(key(1))
    assert d.counters.get("corrupt") == 1
    other = DiskTier(tmp_path, 8, "uint8:4x4", 16)  # another layout reads nothing as KV
    assert other.read(key(2)) is None and other.counters.get("corrupt") == 1
    d.close()
    other.close()


def test_write_errors_are_counted(tmp_path: Path) -> None:
    d = DiskTier(tmp_path / "x", 8, LAYOUT, 16)
    (tmp_path / "x").rename(tmp_path / "gone")
    d.submit(key(0), payload(0))
    assert d.flush()
    assert d.counters.get("errors") == 1 and not d.contains(key(0))
    d.close()


def test_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="kv_disk_dir"):
        DiskTier(tmp_path / "file", 4, LAYOUT, 16)
    with pytest.raises(ValueError, match="kv_disk_size"):
        DiskTier(tmp_path, 0, LAYOUT, 16)
