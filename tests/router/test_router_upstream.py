"""The router's upstream pool against real HTTP/1.1 servers on loopback (scripted answers)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Self

import pytest

from prefixkv.router.upstream import UpstreamError, UpstreamPool, WorkerGone

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Scripted:
    """A loopback server; ``handler(reader, writer, n)`` serves its ``n``-th connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a connection saw its client leave
        self.base = ""

    async def __aenter__(self) -> Self:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer, self.connections)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.closed.set()
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:"))
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def test_answers_come_back_whole_and_the_connection_is_kept_alive() -> None:
    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            while True:
                body = await srv.read_request(reader)
                writer.write(answer(body[::-1], b"x-prefixkv-error-cause: request\r\n"))

        async with Scripted(echo) as srv:
            pool = UpstreamPool(timeout=5)
            for i in range(3):
                resp = await pool.post(srv.base, "/v1/completions", b'{"n": %d}' % i,
                                       {"authorization": "Bearer k", "x-bad": "a\r\nb: c"})
                assert resp.status == 200
                assert resp.headers["x-prefixkv-error-cause"] == "request"
                assert await resp.read() == (b'{"n": %d}' % i)[::-1]
            assert srv.connections == 1
            head = srv.requests[0].split(b"\r\n\r\n")[0].lower()
            assert head.startswith(b"post /v1/completions http/1.1")
            assert b"authorization: bearer k" in head and b"x-bad" not in head
            pool.close()

    run(main())


def test_chunked_pieces_pass_through_as_sent_then_the_connection_is_reused() -> None:
    pieces = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]

    async def main() -> None:
        async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            while True:
                await srv.read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for p in pieces:
                    writer.write(b"%x;ext=1\r\n%s\r\n" % (len(p), p))
                    await writer.drain()
                    await asyncio.sleep(0.05)
                writer.write(b"0\r\ntrailer: x\r\n\r\n")

        async with Scripted(sse) as srv:
            pool = UpstreamPool(timeout=5)
            for _ in range(2):
                resp = await pool.post(srv.base, "/v1/chat/completions", b"{}", {})
                assert [p async for p in resp.chunks()] == pieces
            assert srv.connections == 1
            pool.close()

    run(main())


def test_an_answer_framed_by_close_is_read_to_the_end_and_not_reused() -> None:
    async def main() -> None:
        async def old(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nhello ")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"world")

        async with Scripted(old) as srv:
            pool = UpstreamPool(timeout=5)
            for _ in range(2):
                assert await (await pool.post(srv.base, "/", b"", {})).read() == b"hello world"
            assert srv.connections == 2
            pool.close()

    run(main())


def test_a_stale_idle_connection_is_dropped_and_a_request_it_loses_is_sent_again() -> None:
    async def main() -> None:
        async def flaky(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        n: int) -> None:
            await srv.read_request(reader)
            writer.write(answer(b"first"))
            if n == 1:  # the next request on this connection is read, then dropped unanswered
                await srv.read_request(reader)
                return
            while True:
                await srv.read_request(reader)
                writer.write(answer(b"again"))

        async with Scripted(flaky) as srv:
            pool = UpstreamPool(timeout=5)
            assert await (await pool.post(srv.base, "/", b"1", {})).read() == b"first"
            assert await (await pool.post(srv.base, "/", b"2", {})).read() == b"first"
            assert srv.connections == 2 and len(srv.requests) == 3  # "2" went out twice
            pool.close()

    run(main())


class LateLoop(asyncio.SelectorEventLoop):  # type: ignore[misc,valid-type]
    """An event loop that, once ``late`` is set, resumes a connect only after the peer has
    closed the new connection (a loaded router's loop: its coroutine runs long after the
    handshake, and a dying worker's reset is in by then)."""

    late = False

    async def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        transport, protocol = await super().create_connection(*args, **kwargs)
        for _ in range(500):
            if not self.late or transport.is_closing():
                break
            await asyncio.sleep(0.01)
        return transport, protocol


@pytest.mark.parametrize("then", ["reset", "abandoned"])
def test_a_request_cut_after_writing_whose_resend_fails_is_reported_cut(then: str) -> None:
    """The worker read a request on a reused keep-alive connection and died under it. The
    resend's connect was accepted by its dying socket, which then reset the connection before
    the router's loop wrote to it (``reset``), or the worker left the rotation meanwhile
    (``abandoned``). Either way the worker may have died of this request: the failure is
    ``cut``, so the router judges the death instead of sending the request on to kill the
    next worker as one that never arrived (the old pool raised a plain connect failure or
    ``WorkerGone``, and CI saw a poison request take a second worker that way)."""
    import socket
    import struct

    async def main() -> None:
        async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       n: int) -> None:
            if n == 1:
                await srv.read_request(reader)
                writer.write(answer(b"first"))
                await srv.read_request(reader)  # the poison: read, then the process is gone
                return
            sock = writer.get_extra_info("socket")  # the dying socket's accepted connection
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # reset (RST), before any byte is read
            if then == "abandoned":
                pool.abandon(srv.base)

        loop = asyncio.get_running_loop()
        assert isinstance(loop, LateLoop)
        async with Scripted(dies) as srv:
            pool = UpstreamPool(timeout=5)
            assert await (await pool.post(srv.base, "/", b"1", {})).read() == b"first"
            loop.late = True
            with pytest.raises(UpstreamError) as err:
                await pool.post(srv.base, "/", b"poison", {})
            assert err.value.cut, err.value
            assert srv.connections == 2 and len(srv.requests) == 2  # the poison reached one
            pool.close()

    with asyncio.Runner(loop_factory=LateLoop) as runner:
        runner.run(asyncio.wait_for(main(), 20))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_lost_before_the_request_is_written_is_an_upstream_error(loop: str) -> None:
    """The worker went away between the connect and the write (killed at that moment): the
    request fails with ``UpstreamError``, which the router answers by trying another worker.
    uvloop's ``write`` raised ``RuntimeError`` on the closed transport, which became a 500."""
    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       n: int) -> None:
            while True:
                await srv.read_request(reader)
                writer.write(answer(b"ok"))

        async with Scripted(echo) as srv:
            pool = UpstreamPool(timeout=5)
            connect = pool._connect

            async def lost_at_once(base: str, host: str, port: int) -> Any:
                conn = await connect(base, host, port)
                conn.transport.abort()
                await asyncio.sleep(0)  # connection_lost runs: the transport is closed
                return conn

            pool._connect = lost_at_once  # type: ignore[method-assign]
            with pytest.raises(UpstreamError):
                await pool.post(srv.base, "/", b"1", {})
            pool._connect = connect  # type: ignore[method-assign]
            assert await (await pool.post(srv.base, "/", b"2", {})).read() == b"ok"
            pool.close()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(asyncio.wait_for(main(), 20))
    else:
        run(main())


def test_failures_raise_upstream_error() -> None:
    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         n: int) -> None:
            await srv.read_request(reader)
            if n == 1:
                await asyncio.sleep(10)
            elif n == 2:
                writer.write(b"SPDY/9 nonsense\r\n\r\n")
            elif n == 3:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: -3\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")

        async with Scripted(silent) as srv:
            pool = UpstreamPool(timeout=0.3)
            with pytest.raises(UpstreamError, match="sent nothing for 0.3 s"):
                await pool.post(srv.base, "/", b"", {})
            with pytest.raises(UpstreamError, match="bad status line"):
                await pool.post(srv.base, "/", b"", {})
            with pytest.raises(UpstreamError, match="bad content-length"):
                await pool.post(srv.base, "/", b"", {})
            resp = await pool.post(srv.base, "/", b"", {})
            with pytest.raises(UpstreamError, match="closed the connection mid-answer"):
                await resp.read()
            srv.server.close()
            await srv.server.wait_closed()
            with pytest.raises(UpstreamError, match="cannot connect"):
                await pool.post(srv.base, "/", b"", {})
            with pytest.raises(UpstreamError, match="only http://"):
                await pool.post("https://example.invalid", "/", b"", {})
            pool.close()

    run(main())


def test_abandon_fails_pending_answers_until_readmitted_and_cancel_closes_the_connection() -> None:
    async def main() -> None:
        async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
            await srv.read_request(reader)
            if n == 3:
                writer.write(answer(b"back"))
            await reader.read()  # until the client leaves
            srv.closed.set()

        async with Scripted(hung) as srv:
            pool = UpstreamPool(timeout=30)
            pending = asyncio.ensure_future(pool.post(srv.base, "/", b"", {}))
            await asyncio.sleep(0.1)
            pool.abandon(srv.base)
            with pytest.raises(WorkerGone):
                await pending
            with pytest.raises(WorkerGone):
                await pool.post(srv.base, "/", b"", {})
            pool.readmit(srv.base)
            srv.closed.clear()
            pending = asyncio.ensure_future(pool.post(srv.base, "/", b"", {}))
            await asyncio.sleep(0.1)
            pending.cancel()
            await asyncio.wait_for(srv.closed.wait(), 2)  # the server saw its client leave
            resp = await pool.post(srv.base, "/", b"", {})
            assert await resp.read() == b"back"
            pool.close()

    run(main())


def test_the_raw_asgi_front_over_a_stub_worker() -> None:
    import subprocess
    import sys
    import time

    import httpx

    from prefixkv.router.app import WORKER_HEADER, RouterConfig, RouterServer
    from prefixkv.router.local import free_port

    port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "prefixkv.bench.route.cost", "--stub",
                             str(port)])
    worker = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{worker}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "stub worker did not start"
                time.sleep(0.05)
        with RouterServer(RouterConfig(worker_urls=(worker,))) as server:
            url = f"{server.url}/v1/completions"
            for bad in (b"[1, 2]", b"\xff\xfe", b"{\"prompt\": "):
                r = httpx.post(url, content=bad, timeout=10)
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
            r = httpx.post(url, json={"prompt": "hello " * 1000}, timeout=10)
            assert r.status_code == 200 and r.headers[WORKER_HEADER] == worker
            assert r.json()["object"] == "text_completion"
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=10,
                           json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            assert httpx.get(f"{server.url}/workers").json()["workers"][0]["in_flight"] == 0
    finally:
        stub.terminate()
        stub.wait(timeout=10)
