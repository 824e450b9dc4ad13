from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixkv.tiers.codec import encode
from prefixkv.tiers.disk import DiskTier

LAYOUT = "uint8:16"


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 16


def dead_pid() -> int:
    """The id of a process that has exited."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


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
    leftover = tmp_path / f"{key(9).hex()}.kvb.{dead_pid()}.7f3a.tmp"  # a crashed write's
    leftover.write_bytes(b"half")
    again = DiskTier(tmp_path, 2, LAYOUT, 16)  # restart, smaller: the least recent goes
    assert len(again) == 2 and again.read(key(1)) == payload(1) and again.read(key(3)) == payload(3)
    assert not again.contains(key(2)) and not leftover.exists()
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
    other = DiskTier(tmp_path, 8, "uint8:4x4", 16)  # another layout reads nothing as KV...
    assert other.read(key(2)) is None and not other.contains(key(2))
    assert d.path(key(2)).exists() and other.counters.get("corrupt") == 0  # ...and deletes none
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


def test_only_its_own_files_are_deleted(tmp_path: Path) -> None:
    """(Was: every ``*.tmp`` removed at start and every 64-hex ``.kvb`` indexed, evicted and
    removed on reset, whoever wrote it.) Foreign files survive start-up, eviction and reset;
    the tier's own crash leftovers and records go."""
    ours = DiskTier(tmp_path, 8, LAYOUT, 16)
    ours.submit(key(0), payload(0))
    assert ours.flush()
    ours.close()
    foreign = {
        "notes.tmp": b"a user's file",
        "download.part.123.tmp": b"someone's download",
        f"{key(1).hex()}.kvb": b"not a prefixkv record at all",
        f"{key(2).hex()}.kvb": encode(key(2), "float16:8", b"\0" * 16),  # another layout
        f"{key(3).hex()}.kvb": encode(key(3), LAYOUT, payload(3), b"k"),  # a MAC'd writer's
        f"{key(4).hex()}.kvb": encode(key(5), LAYOUT, payload(5)),  # a record of another key
        f"{key(6).hex()}.kvb.{os.getpid()}.1.tmp": b"a live writer's (this process)",
    }
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    old = time.time() - 3600
    stale = tmp_path / f"{key(7).hex()}.kvb.{os.getpid()}.2.tmp"  # ours, an hour old
    stale.write_bytes(b"half")
    os.utime(stale, (old, old))
    again = DiskTier(tmp_path, 1, LAYOUT, 16)  # capacity 1: only its own record counts
    assert again.stored_keys() == [key(0)] and not stale.exists()
    again.submit(key(8), payload(8))  # evicts key(0), its own, not a foreign file
    assert again.flush() and again.stored_keys() == [key(8)]
    assert again.clear() == 1 and not again.stored_keys()
    again.close()
    assert {p.name for p in tmp_path.iterdir()} == set(foreign)
    for name, data in foreign.items():
        assert (tmp_path / name).read_bytes() == data


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of our own, which the test can remount read-only: a real read-only file system
    (as root, ``chmod 0555`` stops nothing; this needs root's ``mount``, else the test skips)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_directory_turned_read_only_serves_reads_and_counts_writes(
    tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(Was: ``os.utime`` failed on a read-only file system, so every good read was a miss
    with a warning each.) Reads are hits with one warning; writes fail, counted, one warning."""
    d = DiskTier(tmpfs, 64, LAYOUT, 16, clock=lambda: 0.0)
    for i in range(3):
        d.submit(key(i), payload(i))
    assert d.flush()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    with caplog.at_level(logging.WARNING, logger="prefixkv.tiers.disk"):
        for _ in range(5):
            assert [d.read(key(i)) for i in range(3)] == [payload(i) for i in range(3)]
        assert d.counters.get("errors") == 0 and len(caplog.records) == 1
        assert "cannot refresh" in caplog.text and "Read-only file system" in caplog.text
        for i in range(3, 13):
            d.submit(key(i), payload(i))
        assert d.flush()
        assert d.counters.get("errors") == 10 and not d.contains(key(5))
        assert len(caplog.records) == 2 and "write failed" in caplog.records[1].getMessage()
    assert d.read(key(0)) == payload(0) and len(d) == 3
    d.close()


def test_with_a_secret_a_rewritten_file_is_a_counted_miss(tmp_path: Path) -> None:
    """The disk tier's records carry the MAC too: a file rewritten with a recomputed checksum
    is a miss (``unauthenticated``) and removed; an engine without a secret neither indexes nor
    deletes the files, one with another secret reads none of them as KV."""
    import struct

    import xxhash

    d = DiskTier(tmp_path, 8, LAYOUT, 16, secret=b"k1")
    for i in range(2):
        d.submit(key(i), payload(i))
    assert d.flush()
    rec = d.path(key(0)).read_bytes()
    head_len = struct.unpack_from("<H", rec, 6)[0]
    forged = b"\xff" * 16  # payload(0) is zeros
    d.path(key(0)).write_bytes(rec[:16] + struct.pack("<Q", xxhash.xxh64_intdigest(forged))
                               + rec[24:head_len] + forged + rec[head_len + 16:])
    assert d.read(key(0)) is None and not d.path(key(0)).exists()
    assert d.counters.get("unauthenticated") == 1 and d.read(key(1)) == payload(1)
    d.close()
    plain = DiskTier(tmp_path, 1, LAYOUT, 16)
    assert not plain.stored_keys() and plain.clear() == 0
    plain.close()
    again = DiskTier(tmp_path, 8, LAYOUT, 16, secret=b"k1")
    assert again.read(key(1)) == payload(1)
    again.close()
    other = DiskTier(tmp_path, 8, LAYOUT, 16, secret=b"k2")
    assert other.read(key(1)) is None and other.counters.get("unauthenticated") == 1
    other.close()
