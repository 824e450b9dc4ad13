"""Worker deaths and the requests they cut: the router's verdicts, against real loopback
workers (small asyncio HTTP/1.1 servers, raw sockets for the dying one) and on their own."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

import orjson
import pytest

from prefixkv.router.config import RouterConfig
from prefixkv.router.deaths import Deaths, Verdict
from prefixkv.router.keys import completion_key
from prefixkv.router.proxy import WORKER_HEADER, Router
from prefixkv.router.quarantine import Quarantine, fingerprint

OK = b'{"choices": [{"text": "fine"}]}'


def _answer(status: int, body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, len(body), extra, body))


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_post: Callable[[bytes], Awaitable[bytes]]) -> None:
    """HTTP/1.1 keep-alive: ``GET /health`` 200, other GETs 404, POSTs by ``on_post``."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                           if ln.lower().startswith(b"content-length:")), 0)
            body = await reader.readexactly(length)
            if head.startswith(b"POST"):
                writer.write(await on_post(body))
            elif head.startswith(b"GET /health"):
                writer.write(_answer(200, b'{"status": "ok"}'))
            else:
                writer.write(_answer(404, b"{}"))
            await writer.drain()


class DyingWorker:
    """A worker on a raw listening socket. It answers the first POST (naming a stored response,
    so requests continuing it come here), then holds every POST; :meth:`die` stops accepting
    and cuts the held requests' connections (the process is going: connections still reach its
    socket's backlog and get no answer); :meth:`gone` closes the socket (the kernel resets what
    waited in the backlog)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.posts: list[bytes] = []
        self.held = asyncio.Event()  # set on each held POST
        self._dead = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._accept = asyncio.ensure_future(self._accepting())

    async def _accepting(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.sock)
            reader, writer = await asyncio.open_connection(sock=conn)
            self._writers.append(writer)
            asyncio.ensure_future(_serve(reader, writer, self._post))

    async def _post(self, body: bytes) -> bytes:
        self.posts.append(body)
        if len(self.posts) == 1:
            return _answer(200, OK, b"x-prefixkv-response-id: resp_1\r\n")
        self.held.set()
        await self._dead.wait()
        raise ConnectionError("dead")

    async def die(self) -> None:
        self._accept.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._accept
        self._dead.set()
        for writer in self._writers:
            writer.transport.abort()

    def gone(self) -> None:
        self.sock.close()


async def _dispatch(router: Router, prompt: str, *, after: str | None = None) -> tuple[int, str]:
    raw = orjson.dumps({"prompt": prompt, "max_tokens": 2})
    answer = await router.dispatch("/v1/completions", raw, completion_key(orjson.loads(raw)),
                                   False, {}, after=after)
    return answer.status, answer.headers.get(WORKER_HEADER, "")


def test_every_request_one_death_cut_is_judged_by_the_death_as_first_noticed() -> None:
    """A worker killed from outside with two requests in flight. One is noticed at once and
    retried; the other was on a reused keep-alive connection, and its resend reached the dying
    worker's socket and waited there unanswered, so it failed only once the death was confirmed
    (the worker left the rotation). Judged by the worker's in-flight count at its own moment
    (the first one already retried) it looked alone and was answered 502 and quarantined: one
    kill lost two requests where the router chaos test allows one. Judged by the death as first
    noticed (two in flight), both get a strike and are retried and served."""
    async def main() -> None:
        dying = DyingWorker()

        async def fine(body: bytes) -> bytes:
            return _answer(200, OK)

        healthy = await asyncio.start_server(lambda r, w: _serve(r, w, fine), "127.0.0.1", 0)
        good = f"http://127.0.0.1:{healthy.sockets[0].getsockname()[1]}"
        router = Router(RouterConfig(worker_urls=(dying.url, good), policy="round_robin",
                                     health_check_interval=60, health_check_timeout=0.5))
        await router.start()
        try:
            assert await _dispatch(router, "warm") == (200, dying.url)
            # the first takes the pooled keep-alive connection, the second a new one
            reused = asyncio.ensure_future(_dispatch(router, "on the reused one", after="resp_1"))
            await asyncio.wait_for(dying.held.wait(), 5)
            dying.held.clear()
            fresh = asyncio.ensure_future(_dispatch(router, "on a new one", after="resp_1"))
            await asyncio.wait_for(dying.held.wait(), 5)
            assert router.workers[dying.url].in_flight == 2
            await dying.die()
            assert await asyncio.wait_for(fresh, 10) == (200, good)  # probed (no answer): gone
            assert await asyncio.wait_for(reused, 10) == (200, good)
            assert not router.workers[dying.url].healthy and len(dying.posts) == 3
            for prompt in ("on the reused one", "on a new one"):  # a strike each, no quarantine
                fp = fingerprint("POST", "/v1/completions",
                                 orjson.dumps({"prompt": prompt, "max_tokens": 2}))
                assert router.quarantine.has_strike(fp) and router.quarantine.refused_for(fp) is None
        finally:
            await router.stop()
            healthy.close()
            dying.gone()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_verdicts_one_probe_per_death_and_requests_sent_after_it() -> None:
    async def main() -> None:
        answers: list[str | None] = ["refused", None]  # the worker is gone; later it answers
        probes: list[str] = []
        deaths_seen: list[str] = []

        async def probe(url: str) -> str | None:
            probes.append(url)
            await asyncio.sleep(0.01)
            return answers.pop(0)

        q = Quarantine(60.0, 16)
        deaths = Deaths(q, probe, lambda url, error: deaths_seen.append(url))
        a, b, c = (deaths.sent() for _ in range(3))
        judged = [asyncio.ensure_future(deaths.judge("w", fp, n, in_flight=2, error="cut",
                                                     cut=True)) for fp, n in (("a", a), ("b", b))]
        await asyncio.sleep(0)  # both cut requests noticed: the death's record is open
        d = deaths.sent()  # sent after the death was noticed: not among its suspects
        assert await asyncio.gather(*judged) == [Verdict.STRUCK, Verdict.STRUCK]
        assert await deaths.judge("w", "d", d, in_flight=1, error="cut", cut=True) is None
        assert probes == ["w"] and deaths_seen == ["w"]  # one probe, one death for all
        assert q.has_strike("a") and q.refused_for("a") is None and not q.has_strike("d")
        q.hold("w", "c")  # the suspect held there when it died: its second death pins it
        assert await deaths.judge("w", "c", c, in_flight=1, error="gone",
                                  cut=False) is Verdict.PINNED
        assert q.refused_for("c") is not None
        deaths.revived("w")
        assert await deaths.judge("w", "e", deaths.sent(), in_flight=1, error="gone",
                                  cut=False) is None  # abandoned, no death noticed: no probe
        assert await deaths.judge("w", "e", deaths.sent(), in_flight=1, error="cut",
                                  cut=True) is None  # it answers: one dropped connection
        answers.append("refused")
        assert await deaths.judge("w", "f", deaths.sent(), in_flight=1, error="cut",
                                  cut=True) is Verdict.PINNED  # a new death, alone on it
        assert probes == ["w"] * 3 and deaths_seen == ["w", "w"]
        deaths.close()

    asyncio.run(main())


@pytest.mark.parametrize("in_flight", [1, 3])
def test_a_lone_request_is_pinned_and_one_among_others_struck(in_flight: int) -> None:
    async def main() -> None:
        async def gone(url: str) -> str | None:
            return "refused"

        q = Quarantine(60.0, 16)
        deaths = Deaths(q, gone, lambda url, error: None)
        verdict = await deaths.judge("w", "x", deaths.sent(), in_flight=in_flight, error="cut",
                                     cut=True)
        assert verdict is (Verdict.PINNED if in_flight == 1 else Verdict.STRUCK)
        assert (q.refused_for("x") is not None) == (in_flight == 1) and q.has_strike("x")

    asyncio.run(main())
