"""Soft retention in the lower tiers: the host and disk tiers evict retained keys after every
other (lowest priority, then soonest expiry first) until their TTL, pins still win; the remote
tier (a real valkey-server) keeps retained blocks at least the TTL."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.host import HostTier
from prefixkv.tiers.remote import PREFIX, RemoteTier
from prefixkv.tiers.retained import RetainedKeys

LAYOUT = "uint8:16"


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_victims_order_unretained_first_then_priority_then_the_tiers_own() -> None:
    now = [0.0]
    r = RetainedKeys(clock=lambda: now[0])
    keys = [key(i) for i in range(6)]
    assert r.victims(keys, 2) == keys[:2]  # nothing retained: the tier's own order
    r.add(keys[:2], priority=50, ttl_s=10)
    r.add([keys[2]], priority=10, ttl_s=100)
    r.add([keys[3]], priority=50, ttl_s=5)
    assert r.victims(keys, 3) == [keys[4], keys[5], keys[2]]
    assert r.victims(keys, 4) == [keys[4], keys[5], keys[2], keys[0]]  # 50: the tier's order
    r.add([keys[2]], priority=5, ttl_s=1)  # a weaker retention does not replace a live one
    assert r.priority(keys[2]) == 10
    now[0] = 7.0  # keys[3] expired: an ordinary key again, in the tier's order
    assert r.victims(keys, 3) == [keys[3], keys[4], keys[5]]
    assert r.victims(keys, 0) == []
    r.clear()
    assert len(r) == 0 and r.victims(keys, 1) == keys[:1]


def test_host_tier_keeps_retained_blocks_through_a_flood_until_their_ttl() -> None:
    now = [0.0]
    h = HostTier(4)
    h.retained = RetainedKeys(clock=lambda: now[0])
    kept = key(0)
    assert h.reserve(kept) is not None
    h.retained.add([kept], priority=50, ttl_s=60)
    for i in range(1, 40):  # 39 new blocks through a 4-slot tier
        assert h.reserve(key(i)) is not None
    assert kept in h and h.counters.get("evictions") == 36
    h.pinned.add([key(39)])
    for i in range(40, 43):  # the other two unretained, unpinned slots turn over
        h.reserve(key(i))
    assert kept in h and key(39) in h
    now[0] = 61.0  # expired: the least recently used, so the next to go
    h.reserve(key(99))
    assert kept not in h and key(39) in h


def test_host_tier_with_only_retained_blocks_evicts_the_lowest_priority() -> None:
    h = HostTier(2)
    h.reserve(key(0))
    h.reserve(key(1))
    h.retained.add([key(0)], priority=80, ttl_s=100)
    h.retained.add([key(1)], priority=20, ttl_s=100)
    h.reserve(key(2))  # both retained: priority 20 goes
    assert key(0) in h and key(1) not in h


def test_disk_tier_evicts_retained_files_last(tmp_path: Path) -> None:
    now = [0.0]
    d = DiskTier(tmp_path, 3, LAYOUT, 16, clock=lambda: now[0])
    d.retained = RetainedKeys(clock=lambda: now[0])
    d.submit(key(0), b"a" * 16)
    assert d.flush()
    d.retained.add([key(0)], priority=1, ttl_s=30)
    for i in range(1, 10):
        d.submit(key(i), bytes([i]) * 16)
    assert d.flush()
    assert d.read(key(0)) == b"a" * 16 and len(d) == 3
    now[0] = 31.0
    for i in range(10, 13):  # expired: it goes like any other least recently used file
        d.submit(key(i), bytes([i]) * 16)
    assert d.flush()
    assert d.read(key(0)) is None
    d.close()


def test_a_new_block_is_dropped_when_only_retained_files_could_make_room(tmp_path: Path) -> None:
    d = DiskTier(tmp_path, 2, LAYOUT, 16)
    for i in range(2):
        d.submit(key(i), bytes([i]) * 16)
    assert d.flush()
    d.retained.add([key(0), key(1)], priority=50, ttl_s=100)
    d.submit(key(5), b"x" * 16)
    assert d.flush()
    assert d.read(key(5)) is None and d.read(key(0)) is not None and d.read(key(1)) is not None
    assert d.counters.get("dropped") == 1
    d.close()


def test_remote_retained_blocks_live_at_least_their_ttl(valkey: Any) -> None:
    import redis

    client = redis.Redis.from_url(valkey.url)
    r = RemoteTier(valkey.url, LAYOUT, 16, ttl=60)
    for i in range(3):
        r.submit(key(i), bytes([i]) * 16)
    assert r.retain([key(0), key(1)], ttl_s=3600)  # queued after the writes
    assert r.flush()
    assert [client.ttl(PREFIX + key(i)) > 3000 for i in range(3)] == [True, True, False]
    assert r.retain([key(0)], ttl_s=5) and r.flush()  # never shortened
    assert client.ttl(PREFIX + key(0)) > 3000
    r.pin([key(2)], [b"\x02" * 16])
    assert r.retain([key(2)], ttl_s=100) and r.flush()
    assert client.ttl(PREFIX + key(2)) == -1  # pinned: no expiry, and a retention adds none
    r.close()
    r2 = RemoteTier(valkey.url, LAYOUT, 16)  # a tier without a ttl: blocks never expire
    r2.submit(key(7), b"z" * 16)
    assert r2.retain([key(7)], ttl_s=10) and r2.flush()
    assert client.ttl(PREFIX + key(7)) == -1
    r2.close()
