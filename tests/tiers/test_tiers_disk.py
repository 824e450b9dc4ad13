from __future__ import annotations

import hashlib
import logging
import os
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


def test_write_errors_are_counted_and_warned_about_once_a_minute(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk that fails every block (full, gone, read-only) warns once, then once a minute
    with the count: it was one warning per block, thousands a second under load."""
    now = [0.0]
    d = DiskTier(tmp_path / "x", 64, LAYOUT, 16, clock=lambda: now[0])
    (tmp_path / "x").rename(tmp_path / "gone")
    with caplog.at_level(logging.WARNING, logger="prefixkv.tiers.disk"):
        for i in range(20):
            d.submit(key(i), payload(i))
        assert d.flush()
        assert d.counters.get("errors") == 20 and not d.contains(key(0))
        assert len(caplog.records) == 1 and "write failed" in caplog.text
        now[0] = 61.0
        d.submit(key(99), payload(99))
        assert d.flush()
    assert len(caplog.records) == 2 and "20 failed since the last warning" in caplog.text
    d.close()


def test_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="kv_disk_dir .* is not a directory"):
        DiskTier(tmp_path / "file", 4, LAYOUT, 16)
    with pytest.raises(ValueError, match="kv_disk_size"):
        DiskTier(tmp_path, 0, LAYOUT, 16)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_directory_it_cannot_write_is_refused_at_start() -> None:
    """(Was accepted; every block's write then failed. /proc refuses new files even to root,
    where a chmod would not.)"""
    with pytest.raises(ValueError, match="kv_disk_dir '/proc/self' is not usable"):
        DiskTier("/proc/self", 4, LAYOUT, 16)
