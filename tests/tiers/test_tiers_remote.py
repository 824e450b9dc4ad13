"""RemoteTier against a real valkey-server: round trip, corrupt values, the circuit breaker."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from prefixkv.tiers.remote import PREFIX, RemoteTier

LAYOUT = "uint8:16"


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_roundtrip_and_corrupt_values(valkey: Any) -> None:
    import redis

    r = RemoteTier(valkey.url.replace("redis://", "valkey://"), LAYOUT, 16)
    r.submit(key(0), b"a" * 16)
    r.submit(key(1), b"b" * 16)
    r.submit(key(1), b"b" * 16)  # known: skipped
    assert r.flush()
    assert r.counters.get("stored_blocks") == 2
    client = redis.Redis.from_url(valkey.url)
    client.set(PREFIX + key(1), client.get(PREFIX + key(1))[:-1])  # type: ignore[index]
    assert r.read_many([key(0), key(1), key(2)]) == [b"a" * 16, None, None]
    assert r.counters.get("corrupt") == 1 and client.get(PREFIX + key(1)) is None
    assert r.is_known(key(0))
    r.close()


@pytest.mark.parametrize("found_by", ["read", "presence"])
def test_a_block_the_server_dropped_is_published_again(valkey: Any, found_by: str) -> None:
    """Once a read or a presence check finds a published block gone (expired, evicted), the
    engine that wrote it writes it again on its next publish instead of skipping it as known."""
    import redis

    r = RemoteTier(valkey.url, LAYOUT, 16)
    r.submit(key(0), b"a" * 16)
    assert r.flush() and r.is_known(key(0))
    redis.Redis.from_url(valkey.url).delete(PREFIX + key(0))  # as the server's expiry would
    r.submit(key(0), b"a" * 16)  # still known: skipped (nothing says it is gone yet)
    assert r.flush() and r.counters.get("stored_blocks") == 1
    if found_by == "read":
        assert r.read_many([key(0)]) == [None]
    else:
        assert r.present([key(0)]) == [False]
    assert not r.is_known(key(0))
    r.submit(key(0), b"a" * 16)
    assert r.flush() and r.counters.get("stored_blocks") == 2
    assert r.read_many([key(0)]) == [b"a" * 16]
    r.close()


def test_circuit_opens_on_failure_and_closes_after(valkey: Any) -> None:
    now = [0.0]
    r = RemoteTier(valkey.url, LAYOUT, 16, timeout=0.2, retry_after=5.0, clock=lambda: now[0])
    r.submit(key(0), b"a" * 16)
    assert r.flush()
    valkey.kill()
    assert r.read_many([key(0)]) == [None]
    assert r.counters.get("errors") == 1 and not r.is_up
    assert r.read_many([key(0)]) == [None]  # circuit open: no second attempt
    assert r.counters.get("errors") == 1
    r.submit(key(5), b"c" * 16)
    assert r.counters.get("dropped") == 1
    now[0] = 6.0
    assert r.is_up
    assert r.read_many([key(0)]) == [None] and r.counters.get("errors") == 2
    r.close()


def test_bad_url() -> None:
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match="kv_remote"):
        RemoteTier("redis://host:notaport", LAYOUT, 16)


def test_clear_deletes_every_block_and_reports_a_down_server(valkey: Any) -> None:
    import redis

    client = redis.Redis.from_url(valkey.url)
    client.set(b"other:key", b"kept")  # not a prefixkv block
    r = RemoteTier(valkey.url, LAYOUT, 16, timeout=0.2)
    for i in range(1000):  # more than one SCAN/UNLINK batch (queue: 1024)
        r.submit(key(i), bytes([i % 256]) * 16)
    assert r.flush()
    assert r.clear() == 1000
    assert r.read_many([key(0), key(999)]) == [None, None] and not r.is_known(key(0))
    assert client.get(b"other:key") == b"kept"
    r.submit(key(0), b"a" * 16)  # forgotten as "known": published again
    assert r.flush() and r.read_many([key(0)]) == [b"a" * 16]
    valkey.kill()
    assert r.clear() is None and r.counters.get("errors") == 1
    r.close()


def test_pinned_blocks_survive_server_eviction(small_valkey: Any) -> None:
    """Under volatile-lru with a ttl, unpinned blocks are what the server evicts; pinned ones
    have no expiry and stay; the last unpin gives the expiry back; a pinned block the server
    lacks is stored by the pin."""
    import redis

    client = redis.Redis.from_url(small_valkey.url)
    size = 64 * 1024
    r = RemoteTier(small_valkey.url, f"uint8:{size}", size, ttl=3600)
    for i in range(10):
        r.submit(key(i), bytes([i]) * size)
    assert r.flush()
    assert all(0 < client.ttl(PREFIX + key(i)) <= 3600 for i in range(10))
    pinned = [key(i) for i in range(4)] + [key(99)]  # key(99) was never stored
    assert r.pin(pinned, [bytes([i]) * size for i in (0, 1, 2, 3, 99)])
    assert r.pin(pinned[:2], [bytes([i]) * size for i in (0, 1)])  # a second pin of two
    assert r.flush()
    assert [client.ttl(PREFIX + k) for k in pinned] == [-1] * 5  # stored, no expiry
    for i in range(100, 400):  # ~19 MB through an 8 MB server
        r.submit(key(i), bytes([i % 256]) * size)
    assert r.flush() and r.counters.get("errors") == 0
    assert r.read_many(pinned) == [bytes([i]) * size for i in (0, 1, 2, 3, 99)]  # all kept
    others = [key(i) for i in (*range(4, 10), *range(100, 400))]
    assert sum(v is None for v in r.read_many(others)) > 150  # the server evicted unpinned ones
    r.unpin(pinned)
    assert r.flush()
    assert [client.ttl(PREFIX + k) for k in pinned[:2]] == [-1, -1]  # still pinned once
    assert all(0 < client.ttl(PREFIX + k) <= 3600 for k in pinned[2:])
    r.unpin(pinned[:2])
    assert r.flush()
    assert all(0 < client.ttl(PREFIX + k) <= 3600 for k in pinned)
    assert not client.keys(b"pkv:pin:*")  # counters gone with the last unpin
    r.close()


def test_pin_without_ttl_and_while_down(valkey: Any) -> None:
    """Without a ttl blocks carry no expiry (allkeys-lru servers); a pin while the remote is
    down is refused (counted as dropped), never an exception."""
    import redis

    client = redis.Redis.from_url(valkey.url)
    now = [0.0]
    r = RemoteTier(valkey.url, LAYOUT, 16, timeout=0.2, clock=lambda: now[0])
    r.submit(key(0), b"a" * 16)
    assert r.pin([key(0)], [b"a" * 16]) and r.flush()
    assert client.ttl(PREFIX + key(0)) == -1 and client.get(b"pkv:pin:" + key(0)) == b"1"
    valkey.kill()
    assert r.read_many([key(0)]) == [None] and not r.is_up
    assert not r.pin([key(1)], [b"b" * 16])
    assert r.counters.get("dropped") == 1
    r.close()
