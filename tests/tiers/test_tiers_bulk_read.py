"""BulkReader.getranges against a real valkey-server: the bytes redis-py's ``GETRANGE`` reads in
both protocols, megabyte values, many small replies and a reply line longer than the header
buffer, AUTH and SELECT, and a cut, paused or killed server (an error, then a fresh
connection)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from prefixkv.tiers.bulk_read import BulkReader, Range

redis = pytest.importorskip("redis")
PASSWORD = "pa55word"  # the valkey_auth fixture's (tests/tiers/conftest.py)
WHOLE = 1 << 40
"""A range end past any value: ``GETRANGE`` clamps it, so the range is the whole value."""


class Replies:
    """What :meth:`BulkReader.getranges` delivered: each part's replies (in the order ``into``
    was asked for them) and the ``(part, i)`` of each ``done``."""

    def __init__(self, parts: int, pieces: int = 1) -> None:
        self.values: list[list[bytearray]] = [[] for _ in range(parts)]
        self.done: list[tuple[int, int]] = []
        self._pieces = pieces
        self._lock = threading.Lock()

    def into(self, part: int, i: int, size: int) -> Sequence[memoryview]:
        assert i == len(self.values[part])  # replies are asked for in order
        out = bytearray(size)
        self.values[part].append(out)
        view = memoryview(out)
        step = -(-size // self._pieces) or 1  # several buffers: one reply spread over them
        return [view[a:a + step] for a in range(0, size, step)] or [view]

    def on_done(self, part: int, i: int) -> None:
        with self._lock:
            self.done.append((part, i))


def _read(reader: BulkReader, parts: Sequence[Sequence[Sequence[Range]]],
          pieces: int = 1) -> Replies:
    got = Replies(len(parts), pieces)
    reader.getranges(parts, got.into, got.on_done)
    return got


def _whole(reader: BulkReader, keys: Sequence[bytes], batch: int = 64) -> list[bytes]:
    """``keys``' values (``b""`` for a miss) read as ``StreamedRead`` splits a batch: contiguous
    parts, one per connection, each in pipelined batches of ``batch`` ranges."""
    n = max(1, min(reader.connections, len(keys)))
    step = -(-len(keys) // n)
    parts = [keys[a:a + step] for a in range(0, len(keys), step)]
    got = _read(reader, [[[(k, 0, WHOLE) for k in p[b:b + batch]]
                          for b in range(0, len(p), batch)] for p in parts])
    for j, p in enumerate(parts):  # each reply done once, after its buffers, in order
        assert [i for part, i in got.done if part == j] == list(range(len(p)))
    return [bytes(v) for vs in got.values for v in vs]


@pytest.mark.parametrize("protocol", [2, 3])
def test_it_reads_what_redis_py_reads(valkey: Any, protocol: int) -> None:
    client = redis.Redis.from_url(valkey.url, protocol=protocol)
    big = os.urandom(3 << 20)
    client.set(b"big", big)
    client.set(b"empty", b"")
    client.set(b"crlf", b"\r\n$-1\r\n_\r\n")  # values that look like reply syntax
    client.rpush(b"list", b"x")  # not a string: WRONGTYPE, read as no bytes
    ranges = [(b"big", 0, WHOLE), (b"missing", 0, 10), (b"empty", 0, 1), (b"crlf", 0, WHOLE),
              (b"big", 5, 1 << 20), (b"list", 0, 10), (b"big", (3 << 20) - 7, WHOLE)]
    want = [client.getrange(k, a, b - 1) for k, a, b in ranges if k != b"list"]
    want.insert(5, b"")
    reader = BulkReader(client)
    got = _read(reader, [[ranges[:3], ranges[3:]]], pieces=3)  # two pipelined batches
    assert got.values[0] == want and got.values[0][0] == big
    assert got.done == [(0, i) for i in range(len(ranges))]
    reader.close()


def test_many_small_values_span_the_header_buffer(valkey: Any) -> None:
    client = redis.Redis.from_url(valkey.url)
    keys = [b"k%05d" % i for i in range(5000)]  # ~100 KB of reply headers and values
    client.mset({k: k * (i % 7) for i, k in enumerate(keys)})
    reader = BulkReader(client)
    assert _whole(reader, keys, batch=700) == [v or b"" for v in client.mget(keys)]
    reader.getranges([], Replies(0).into, Replies(0).on_done)  # nothing asked: nothing sent
    assert _read(reader, [[[], []]]).values == [[]]
    reader.close()


def test_password_and_database_come_from_the_url(valkey_auth: Any) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{valkey_auth.port}"
    redis.Redis.from_url(url + "/0").set(b"k", b"db0")
    redis.Redis.from_url(url + "/3").set(b"k", b"db3")
    assert _whole(BulkReader(redis.Redis.from_url(url + "/3")), [b"k"]) == [b"db3"]
    assert _whole(BulkReader(redis.Redis.from_url(url + "/0")), [b"k"]) == [b"db0"]
    wrong = redis.Redis.from_url(f"redis://:nope@127.0.0.1:{valkey_auth.port}/3")
    with pytest.raises(redis.exceptions.AuthenticationError):
        _whole(BulkReader(wrong), [b"k"])


def test_a_cut_connection_fails_once_then_reconnects(valkey: Any) -> None:
    client = redis.Redis.from_url(valkey.url)
    client.set(b"k", b"v")
    reader = BulkReader(client)
    assert _whole(reader, [b"k"]) == [b"v"]
    assert client.client_kill_filter(_type="normal", skipme=True) >= 1  # the reader's connection
    with pytest.raises((ConnectionError, OSError)):
        _whole(reader, [b"k"])
    assert _whole(reader, [b"k"]) == [b"v"]
    assert _whole(reader, [b"k"]) == [b"v"]  # the new connection is kept
    reader.close()


def test_a_paused_server_times_out_and_a_dead_one_refuses(valkey: Any) -> None:
    client = redis.Redis.from_url(valkey.url, socket_timeout=0.2)
    client.set(b"k", b"v")
    reader = BulkReader(client)
    assert _whole(reader, [b"k"]) == [b"v"]
    redis.Redis.from_url(valkey.url).execute_command("CLIENT", "PAUSE", "600", "ALL")
    with pytest.raises((socket.timeout, TimeoutError, redis.exceptions.TimeoutError)):
        _whole(reader, [b"k"])
    valkey.kill()
    with pytest.raises((ConnectionError, OSError, redis.exceptions.ConnectionError)):
        _whole(reader, [b"k"])
    reader.close()


def _cut(client: Any, conn_sock: socket.socket) -> None:
    """Kill the server's end of one of the reader's connections (by its address)."""
    host, port = conn_sock.getsockname()[:2]
    assert client.execute_command("CLIENT", "KILL", f"{host}:{port}")


def test_a_batch_split_over_connections_keeps_its_order_and_fails_whole(
    valkey: Any
) -> None:
    client = redis.Redis.from_url(valkey.url)
    keys = [b"p%d" % i for i in range(7)]
    client.mset({k: k * 1000 for k in keys[::2]})  # every other key: misses between hits
    reader = BulkReader(client, connections=3)
    want = [v or b"" for v in client.mget(keys)]
    assert _whole(reader, keys, batch=2) == want  # parts of 3, 3, 1 over three connections
    assert client.client_kill_filter(_type="normal", skipme=True) >= 3
    with pytest.raises((ConnectionError, OSError)):
        _whole(reader, keys)  # every part's connection was cut: the batch fails
    assert _whole(reader, keys) == want  # each connection opens again

    # one part fails at once while another is still reading: the call raises only once every
    # part has stopped (no ``into`` / ``done`` after it returns), and the intact part is whole
    client.mset({b"slow%d" % i: os.urandom(1 << 20) for i in range(24)})
    slow = [[(b"slow%d" % i, 0, WHOLE)] for i in range(24)]  # 24 batches of 1 MB
    _cut(client, reader._conns[0]._sock)  # type: ignore[arg-type]
    got = Replies(2)
    with pytest.raises((ConnectionError, OSError)):
        reader.getranges([[[(keys[0], 0, WHOLE)]], slow], got.into, got.on_done)
    assert got.values[0] == [] and len(got.values[1]) == 24
    assert got.done == [(1, i) for i in range(24)]
    assert got.values[1][23] == client.get(b"slow23")
    assert _whole(reader, keys) == want

    reader.close()
    assert _whole(reader, keys[:1]) == [keys[0] * 1000]  # usable after close (reconnects)
    with pytest.raises(ValueError, match="parts"):
        reader.getranges([[], [], [], []], got.into, got.on_done)
    reader.close()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="connections"):
            BulkReader(client, connections=bad)  # type: ignore[arg-type]


def test_a_reply_line_longer_than_the_header_buffer_is_read_whole() -> None:
    """A line past the 64 KiB header buffer grows it: a ``WRONGTYPE`` error three buffers long
    (no bytes for its range) and then the next reply, read right after it (the connection is a
    socket pair standing in for the server's end)."""
    from prefixkv.tiers.bulk_read import _CHUNK, _Connection

    ours, theirs = socket.socketpair()
    conn = _Connection(redis.Redis())  # its pool is never asked: the socket is given
    conn._sock = ours
    reply = b"-WRONGTYPE " + b"E" * (3 * _CHUNK) + b"\r\n$3\r\nabc\r\n"
    sender = threading.Thread(target=theirs.sendall, args=(reply,))
    sender.start()
    got = Replies(1)
    conn.getrange(0, [[(b"a", 0, 1), (b"b", 0, 3)]], got.into, got.on_done)
    sender.join()
    assert got.values == [[b"", b"abc"]] and got.done == [(0, 0), (0, 1)]
    ours.close()
    theirs.close()
