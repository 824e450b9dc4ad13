"""StreamedRead over a real valkey-server: records read in pieces into the caller's buffers, each
piece ready for every block before the next, and every check ``decode`` makes (missing,
truncated, damaged, unauthenticated, a server that dies mid-read)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from prefixkv.tiers.codec import CorruptBlockError, UnauthenticatedBlockError, encode
from prefixkv.tiers.range_read import MISSING, OK, UNREAD, StreamedRead
from prefixkv.tiers.remote import PREFIX, RemoteTier

NB = 48_000
CUTS = [0, 1_000, 17_000, 30_000, NB]


def _blocks(tier: RemoteTier, n: int) -> tuple[list[bytes], list[bytes]]:
    keys = [os.urandom(32) for _ in range(n)]
    pays = [os.urandom(NB) for _ in range(n)]
    for k, p in zip(keys, pays):
        tier.submit(k, p)
    assert tier.flush(10)
    return keys, pays


def _read(tier: RemoteTier, keys: Sequence[bytes],
          on_piece: list[tuple[int, list[bytes]]] | None = None) -> tuple[list[bool], list[bytearray], StreamedRead]:
    """Read ``keys`` in pieces; with ``on_piece``, a thread records what every block's piece g
    holds the moment ``wait(g)`` returns."""
    outs = [bytearray(NB) for _ in keys]
    read = tier.streamed(keys, CUTS, lambda i, g: [memoryview(outs[i])[CUTS[g]:CUTS[g + 1]]])
    watcher = None
    if on_piece is not None:
        def watch() -> None:
            for g in range(len(CUTS) - 1):
                assert read.wait(g, timeout=10)
                on_piece.append((g, [bytes(o[CUTS[g]:CUTS[g + 1]]) for o in outs]))
        watcher = threading.Thread(target=watch)
        watcher.start()
    ok = tier.read_streamed(read)
    if watcher is not None:
        watcher.join(10)
    return ok, outs, read


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_pieces_arrive_in_order_into_the_callers_buffers(valkey: Any,
                                                         secret: bytes | None) -> None:
    tier = RemoteTier(valkey.url, "f32:2x4", NB, timeout=2.0, secret=secret)
    keys, pays = _blocks(tier, 7)  # 7 blocks over 3 connections: parts of 3, 3, 1
    seen: list[tuple[int, list[bytes]]] = []
    ok, outs, read = _read(tier, keys, seen)
    assert ok == [True] * 7 and read.state == [OK] * 7
    assert outs == [bytearray(p) for p in pays]
    assert [g for g, _ in seen] == [0, 1, 2, 3]
    for g, pieces in seen:  # when wait(g) returned, piece g of every block was in place
        assert pieces == [p[CUTS[g]:CUTS[g + 1]] for p in pays]
    assert all(tier.is_known(k) for k in keys)
    tier.close()


def test_missing_truncated_and_damaged_records_fail_only_their_blocks(valkey: Any) -> None:
    tier = RemoteTier(valkey.url, "f32:2x4", NB, timeout=2.0)
    keys, pays = _blocks(tier, 5)
    client = tier._client
    record = client.get(PREFIX + keys[1])
    client.set(PREFIX + keys[1], record[:-5_000])  # truncated in the last piece
    damaged = bytearray(client.get(PREFIX + keys[2]))
    damaged[-1] ^= 0xFF  # a payload byte: only the checksum can tell
    client.set(PREFIX + keys[2], bytes(damaged))
    client.set(PREFIX + keys[3], encode(keys[4], "f32:2x4", pays[4]))  # another key's record
    absent = os.urandom(32)
    listed = os.urandom(32)
    client.rpush(PREFIX + listed, b"x")  # not a string: a miss, as MGET's nil, not a failure
    ok, outs, read = _read(tier, [keys[0], keys[1], keys[2], keys[3], absent, listed])
    assert ok == [True, False, False, False, False, False]
    assert read.state[0] == OK and read.state[4] == read.state[5] == MISSING
    assert tier.is_up and tier.counters.get("errors") == 0
    assert "truncated" in str(read.state[1]) and "checksum" in str(read.state[2])
    assert "another key" in str(read.state[3])
    assert outs[0] == pays[0]
    assert tier.counters.get("corrupt") == 3
    assert client.exists(PREFIX + keys[1], PREFIX + keys[2], PREFIX + keys[3]) == 0  # deleted
    assert not tier.is_known(keys[1]) and not tier.is_known(absent)
    tier.close()


def test_a_record_without_the_mac_or_under_another_secret_is_refused(valkey: Any) -> None:
    plain = RemoteTier(valkey.url, "f32:2x4", NB, timeout=2.0)
    other = RemoteTier(valkey.url, "f32:2x4", NB, timeout=2.0, secret=b"other")
    (k1,), _ = _blocks(plain, 1)
    (k2,), _ = _blocks(other, 1)
    reader = RemoteTier(valkey.url, "f32:2x4", NB, timeout=2.0, secret=b"mine")
    ok, _, read = _read(reader, [k1, k2])
    assert ok == [False, False]
    assert all(isinstance(st, UnauthenticatedBlockError) for st in read.state)
    assert reader.counters.get("unauthenticated") == 2
    for t in (plain, other, reader):
        t.close()


def test_a_server_that_dies_mid_read_releases_the_waiters(valkey: Any) -> None:
    tier = RemoteTier(valkey.url, "f32:2x4", NB, timeout=1.0)
    keys, _ = _blocks(tier, 4)
    outs = [bytearray(NB) for _ in keys]

    def place(i: int, g: int) -> list[memoryview]:
        if g == 1:
            valkey.kill()  # piece 0 has arrived; the rest never will
        return [memoryview(outs[i])[CUTS[g]:CUTS[g + 1]]]

    read = tier.streamed(keys, CUTS, place)
    ok = tier.read_streamed(read)
    assert ok == [False] * 4 and all(st == UNREAD for st in read.state)
    assert read.wait(3, timeout=1)  # nobody waits forever on a dead server
    assert not tier.is_up and tier.counters.get("errors") == 1
    assert tier.read_streamed(tier.streamed(keys, CUTS, place)) == [False] * 4  # circuit open
    tier.close()


def test_cuts_must_run_from_zero_to_the_block_size() -> None:
    for cuts in ([0], [1, NB], [0, 10, 10, NB], [0, NB - 1]):
        with pytest.raises(ValueError, match="cuts"):
            StreamedRead([b"a"], [b"a"], "x", NB, cuts, lambda i, g: [])
    with pytest.raises(CorruptBlockError):  # RecordCheck: too few payload bytes is no block
        from prefixkv.tiers.codec import RecordCheck
        check = RecordCheck(b"k" * 32, "x", NB)
        check.head(encode(b"k" * 32, "x", b"\0" * NB)[:-NB])
        check.update(b"\0" * (NB - 1))
        check.finish()
