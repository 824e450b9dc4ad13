"""A small keep-alive HTTP/1.1 client for the router's proxied requests (the workers' OpenAI routes).

Contract. :meth:`UpstreamPool.post` sends one POST over a pooled connection to a worker and
returns an :class:`UpstreamResponse` once the status line and headers are in. ``await
resp.read()`` returns the whole body; ``resp.chunks()`` yields it as it arrives (the chunked
transfer coding removed; pieces passed on as received, never joined or re-split). The caller
reads to the end (the connection then goes back to the pool) or calls :meth:`UpstreamResponse.close`
(the connection is aborted at once, so the worker sees its client go away); cancelling a read does
the same. Idle connections the worker closes leave the pool as soon as the close arrives.

Failures. Every transport failure raises :class:`UpstreamError`: refused, reset or closed
mid-answer, a malformed answer, nothing received for ``timeout`` seconds (``connect_timeout``
to connect). A POST that fails on a reused idle connection before any byte of the answer arrived
is sent once more on a fresh connection (the worker closed the idle connection as it was
picked); when the first try had been written and cut, a failed resend is reported ``cut``
whatever its own failure (the worker may have died under the request).
:meth:`UpstreamPool.abandon` makes every pending and later read of a worker's in-flight answers
raise :class:`WorkerGone` (the worker left the rotation).

Ownership: a connection is idle in the pool, or owned by exactly one request or response.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import cast
from urllib.parse import urlsplit

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse", "WorkerGone"]

_MAX_HEAD = 65536
_PAUSE_AT = 1 << 20  # buffered answer bytes before reading from the socket pauses


class UpstreamError(Exception):
    """The worker could not be reached or broke its answer off (a transport failure).

    ``cut``: the worker's side closed or reset the connection after the request was written
    (what a worker dying under the request looks like); ``False`` for a refused or failed
    connect, a timeout or a malformed answer."""

    def __init__(self, message: str, *, cut: bool = False) -> None:
        super().__init__(message)
        self.cut = cut


class WorkerGone(Exception):
    """The worker left the rotation while this request waited on it."""


class _Conn(asyncio.Protocol):
    """One connection: received bytes in ``buf``; ``fill`` waits for more."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: UpstreamPool, base: str) -> None:
        self.loop, self.pool, self.base = loop, pool, base
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False  # EOF or connection lost
        self.failure: BaseException | None = None  # set by abandon
        self.paused = False
        self.received = False  # any answer byte since the last request was written

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.received = True
        if len(self.buf) > _PAUSE_AT and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def eof_received(self) -> bool:
        self._lost()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()

    def _lost(self) -> None:
        self.closed = True
        self.pool._forget_idle(self)
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Make the pending and later reads raise ``exc``; abort the connection."""
        self.failure = exc
        self.abort()
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def fill(self, timeout: float) -> None:
        """Wait until more bytes arrive (``UpstreamError`` on close or timeout)."""
        if self.failure is not None:
            raise self.failure
        if self.closed:
            raise UpstreamError(f"{self.base} closed the connection mid-answer", cut=True)
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        w = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, _expire, w, self.base, timeout)
        try:
            await w
        except BaseException:
            self.abort()
            raise
        finally:
            timer.cancel()
            self.waiter = None
        if self.failure is not None:
            raise self.failure

    def take(self, n: int) -> bytes:
        piece = bytes(self.buf[:n])
        del self.buf[:n]
        return piece

    async def line(self, timeout: float) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > _MAX_HEAD:
                raise UpstreamError(f"{self.base} sent an overlong line")
            await self.fill(timeout)
        piece = self.take(i + 2)
        return piece[:-2]


def _resend_failed(exc: UpstreamError | WorkerGone) -> UpstreamError:
    """The resend of a request whose first try was written and cut failed (``exc``). The worker
    may have taken the request and died under it, so however the resend failed (refused; a dying
    worker's socket accepting the connect, then resetting it before the write; the worker
    leaving the rotation meanwhile), the failure is ``cut``: the router judges the death
    (:mod:`prefixkv.router.deaths`) instead of sending the request on to the next worker as one
    that never arrived."""
    return UpstreamError(f"{exc} (resending a request cut after it was sent)", cut=True)


def _expire(w: asyncio.Future[None], base: str, timeout: float) -> None:
    if not w.done():
        w.set_exception(UpstreamError(f"{base} sent nothing for {timeout:g} s"))


class UpstreamResponse:
    """A worker's answer: ``status``, ``headers`` (lower-case names), then the body."""

    def __init__(self, conn: _Conn, status: int, headers: dict[str, str], timeout: float) -> None:
        self.status, self.headers = status, headers
        self._conn: _Conn | None = conn
        self._timeout = timeout
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        length = "0" if status in (204, 304) else headers.get("content-length")
        try:
            self._length = None if self._chunked or length is None else int(length)
        except ValueError:
            self._length = -1
        if self._length is not None and self._length < 0:
            raise UpstreamError(f"{conn.base} sent a bad content-length {length!r}")
        self._reuse = (headers.get("connection", "").lower() != "close"
                       and (self._chunked or self._length is not None))

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        conn = self._conn
        if self._length is not None and conn is not None:
            try:
                while len(conn.buf) < self._length:
                    await conn.fill(self._timeout)
            except BaseException:
                self.close()
                raise
            body = conn.take(self._length)
            self._release()
            return body
        return b"".join([piece async for piece in self.chunks()])

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives; closing the iterator early aborts the connection."""
        conn = self._conn
        if conn is None:
            return
        complete = False
        try:
            if self._chunked:
                async for piece in self._dechunk(conn):
                    yield piece
            elif self._length is not None:
                async for piece in self._exactly(conn, self._length):
                    yield piece
            else:  # until the worker closes
                while True:
                    if conn.buf:
                        yield conn.take(len(conn.buf))
                    if conn.closed and conn.failure is None:
                        break
                    await conn.fill(self._timeout)
            complete = True
        finally:
            if complete:
                self._release()
            else:
                self.close()

    async def _exactly(self, conn: _Conn, n: int) -> AsyncGenerator[bytes, None]:
        """The next ``n`` body bytes, in the pieces they arrive in."""
        left = n
        while left:
            if not conn.buf:
                await conn.fill(self._timeout)
            piece = conn.take(min(left, len(conn.buf)))
            left -= len(piece)
            yield piece

    async def _dechunk(self, conn: _Conn) -> AsyncGenerator[bytes, None]:
        while True:
            size_line = await conn.line(self._timeout)
            try:
                size = int(size_line.split(b";", 1)[0], 16)
            except ValueError:
                raise UpstreamError(f"{conn.base} sent a bad chunk size {size_line!r}") from None
            if size == 0:
                while await conn.line(self._timeout):  # trailers, then the empty line
                    pass
                return
            async for piece in self._exactly(conn, size):
                yield piece
            if await conn.line(self._timeout):
                raise UpstreamError(f"{conn.base} sent a chunk without its CRLF")

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.pool._put(conn, reuse=self._reuse and not conn.buf)

    def close(self) -> None:
        """Abort the connection unless the body was read to the end (idempotent)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.pool._put(conn, reuse=False)


class UpstreamPool:
    """Keep-alive connections to the workers, per worker base URL (``http://host:port``)."""

    def __init__(self, *, timeout: float, connect_timeout: float = 5.0, max_idle: int = 256):
        self.timeout, self.connect_timeout, self.max_idle = timeout, connect_timeout, max_idle
        self._idle: dict[str, list[_Conn]] = {}
        self._busy: dict[str, set[_Conn]] = {}
        self._addr: dict[str, tuple[str, int, bytes]] = {}
        self._gone: set[str] = set()

    def _address(self, base: str) -> tuple[str, int, bytes]:
        addr = self._addr.get(base)
        if addr is None:
            parts = urlsplit(base)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamError(f"only http:// workers are supported, got {base!r}")
            port = parts.port or 80
            addr = self._addr[base] = (parts.hostname, port, parts.netloc.encode())
        return addr

    async def post(self, base: str, path: str, body: bytes,
                   headers: Mapping[str, str]) -> UpstreamResponse:
        """Send ``POST base+path`` with ``body``; the answer once its headers are in."""
        host, port, netloc = self._address(base)
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\nhost: ", netloc,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            if "\r" not in value and "\n" not in value:
                head += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        head += [b"\r\n", body]
        message = b"".join(head)
        written_and_cut = False  # the first try, on an idle connection, was cut after writing
        for attempt in range(2):
            idle = self._idle.get(base)
            reused = bool(idle) and attempt == 0
            try:
                conn = idle.pop() if reused and idle else await self._connect(base, host, port)
            except UpstreamError as exc:
                if written_and_cut:
                    raise _resend_failed(exc) from exc
                raise
            if base in self._gone:
                self._put(conn, reuse=True)
                raise _resend_failed(WorkerGone(base)) if written_and_cut else WorkerGone(base)
            self._busy.setdefault(base, set()).add(conn)
            conn.received = False
            assert conn.transport is not None
            wrote = False
            try:
                if conn.closed or conn.transport.is_closing():  # lost since it was connected or
                    # idle (uvloop's write would raise RuntimeError; asyncio's drops the bytes)
                    raise UpstreamError(f"{base} closed the connection before the request")
                conn.transport.write(message)
                wrote = True
                status, answer_headers = await self._head(conn)
                return UpstreamResponse(conn, status, answer_headers, self.timeout)
            except (UpstreamError, WorkerGone) as exc:
                self._put(conn, reuse=False)
                if (reused and isinstance(exc, UpstreamError) and not conn.received
                        and conn.failure is None):
                    written_and_cut = wrote and exc.cut
                    continue
                if written_and_cut:
                    raise _resend_failed(exc) from exc
                raise
            except BaseException:
                self._put(conn, reuse=False)
                raise
        raise AssertionError("unreachable")

    async def _connect(self, base: str, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(loop, self, base), host, port),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {base}: {type(exc).__name__} {exc}") from exc
        return conn

    async def _head(self, conn: _Conn) -> tuple[int, dict[str, str]]:
        while (end := conn.buf.find(b"\r\n\r\n")) < 0:
            if len(conn.buf) > _MAX_HEAD:
                raise UpstreamError(f"{conn.base} sent an overlong header")
            await conn.fill(self.timeout)
        lines = conn.take(end + 4).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise UpstreamError(f"{conn.base} sent a bad status line {lines[0]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:-2]:
            name, sep, value = line.partition(":")
            if not sep:
                raise UpstreamError(f"{conn.base} sent a bad header line {line!r}")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    def _put(self, conn: _Conn, *, reuse: bool) -> None:
        """Take ``conn`` back from its request: to the idle list, or aborted."""
        busy = self._busy.get(conn.base)
        if busy is not None:
            busy.discard(conn)
        idle = self._idle.setdefault(conn.base, [])
        if reuse and not conn.closed and conn.failure is None and len(idle) < self.max_idle:
            if conn.paused and conn.transport is not None:
                conn.paused = False
                conn.transport.resume_reading()
            idle.append(conn)
        else:
            conn.abort()

    def _forget_idle(self, conn: _Conn) -> None:
        idle = self._idle.get(conn.base)
        if idle and conn in idle:
            idle.remove(conn)
            if conn.transport is not None:
                conn.transport.close()

    def abandon(self, base: str) -> None:
        """Fail every in-flight answer from ``base``, and every POST to it until
        :meth:`readmit`, with :class:`WorkerGone`."""
        self._gone.add(base)
        for conn in list(self._busy.pop(base, ())):
            conn.fail(WorkerGone(base))

    def readmit(self, base: str) -> None:
        """``base`` is back in the rotation: POSTs to it are sent again."""
        self._gone.discard(base)

    def close(self) -> None:
        """Abort every connection (idle and in flight)."""
        for conns in [*self._idle.values(), *self._busy.values()]:
            for conn in list(conns):
                conn.abort()
        self._idle.clear()
        self._busy.clear()
