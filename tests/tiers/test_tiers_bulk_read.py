"""BulkReader against a real valkey-server: the values redis-py reads, misses in both protocols,
megabyte values and replies longer than its header buffer, AUTH and SELECT, and a cut, paused
or killed server (an error, then a fresh connection)."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from prefixkv.tiers.bulk_read import BulkReader

redis = pytest.importorskip("redis")
PASSWORD = "pa55word"  # the valkey_auth fixture's (tests/tiers/conftest.py)


@pytest.mark.parametrize("protocol", [2, 3])
def test_it_reads_what_redis_py_reads(valkey: Any, protocol: int) -> None:
    client = redis.Redis.from_url(valkey.url, protocol=protocol)
    big = os.urandom(3 << 20)
    client.set(b"big", big)
    client.set(b"empty", b"")
    client.set(b"crlf", b"\r\n$-1\r\n_\r\n")  # values that look like reply syntax
    keys = [b"big", b"missing", b"empty", b"crlf", b"big"]
    got = BulkReader(client).mget(keys)
    assert got == client.mget(keys)
    assert got[0] == big and got[1] is None and got[2] == b"" and isinstance(got[0], bytearray)


def test_many_small_values_span_the_header_buffer(valkey: Any) -> None:
    client = redis.Redis.from_url(valkey.url)
    keys = [b"k%05d" % i for i in range(5000)]  # ~100 KB of reply headers and values
    client.mset({k: k * (i % 7) for i, k in enumerate(keys)})
    reader = BulkReader(client)
    assert reader.mget(keys) == client.mget(keys)
    assert reader.mget([]) == []


def test_password_and_database_come_from_the_url(valkey_auth: Any) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{valkey_auth.port}"
    redis.Redis.from_url(url + "/0").set(b"k", b"db0")
    redis.Redis.from_url(url + "/3").set(b"k", b"db3")
    assert BulkReader(redis.Redis.from_url(url + "/3")).mget([b"k"]) == [b"db3"]
    wrong = redis.Redis.from_url(f"redis://:nope@127.0.0.1:{valkey_auth.port}/3")
    with pytest.raises(redis.exceptions.AuthenticationError):
        BulkReader(wrong).mget([b"k"])


def test_a_cut_connection_fails_once_then_reconnects(valkey: Any) -> None:
    client = redis.Redis.from_url(valkey.url)
    client.set(b"k", b"v")
    reader = BulkReader(client)
    assert reader.mget([b"k"]) == [b"v"]
    assert client.client_kill_filter(_type="normal", skipme=True) >= 1  # the reader's connection
    with pytest.raises((ConnectionError, OSError)):
        reader.mget([b"k"])
    assert reader.mget([b"k"]) == [b"v"]


def test_a_paused_server_times_out_and_a_dead_one_refuses(valkey: Any) -> None:
    client = redis.Redis.from_url(valkey.url, socket_timeout=0.2)
    client.set(b"k", b"v")
    reader = BulkReader(client)
    assert reader.mget([b"k"]) == [b"v"]
    redis.Redis.from_url(valkey.url).execute_command("CLIENT", "PAUSE", "600", "ALL")
    with pytest.raises((socket.timeout, TimeoutError, redis.exceptions.TimeoutError)):
        reader.mget([b"k"])
    valkey.kill()
    with pytest.raises((ConnectionError, OSError, redis.exceptions.ConnectionError)):
        reader.mget([b"k"])
    reader.close()


def test_a_batch_split_over_connections_keeps_its_order_and_fails_whole(
    valkey: Any
) -> None:
    client = redis.Redis.from_url(valkey.url)
    keys = [b"p%d" % i for i in range(7)]
    client.mset({k: k * 1000 for k in keys[::2]})  # every other key: misses between hits
    reader = BulkReader(client, connections=3)
    assert reader.mget(keys) == client.mget(keys)
    assert client.client_kill_filter(_type="normal", skipme=True) >= 3
    with pytest.raises((ConnectionError, OSError)):
        reader.mget(keys)  # every part's connection was cut: the batch fails, nothing partial
    assert reader.mget(keys) == client.mget(keys)  # each connection opens again
    reader.close()
    assert reader.mget(keys[:1]) == [keys[0] * 1000]  # usable after close (reconnects)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="connections"):
            BulkReader(client, connections=bad)  # type: ignore[arg-type]


def test_a_reply_line_longer_than_the_header_buffer_is_read_whole() -> None:
    """A line past the 64 KiB header buffer grows it (an error reply here; the connection is
    a socket pair standing in for the server's end)."""
    from prefixkv.tiers.bulk_read import _CHUNK, _Connection

    ours, theirs = socket.socketpair()
    conn = _Connection(redis.Redis())  # its pool is never asked: the socket is given
    conn._sock = ours
    message = b"E" * (3 * _CHUNK)
    theirs.sendall(b"*1\r\n-" + message + b"\r\n")
    assert conn._line() == b"*1"
    assert conn._line() == b"-" + message
    ours.close()
    theirs.close()
