"""One worker's KV event stream, followed on the router's event loop (ZMQ SUB, asyncio), and
where streams come from (``--kv-events`` values, or the worker's ``GET /kv_events``).

Contract. :meth:`EventStream.run` subscribes to the worker's PUB endpoint (vLLM's framing:
``topic, seq, payload``; see :mod:`prefixkv.engine.kv_events_zmq`), decodes each payload as a
:class:`~prefixkv.wire.kv_events.KVEventBatch` and applies it to the
:class:`~prefixkv.router.kv_index.ExactIndex` in sequence order, until cancelled. Sequence
numbers decide what the index can trust:

* the next number: applied;
* a jump (batches were lost, or the stream was joined late): the missing batches are asked from
  the worker's replay socket when it has one, and applied if every one came back; otherwise the
  worker's blocks are dropped and it is marked incomplete (``gaps`` counts these);
* a number not above the last one: the worker restarted (its cache is empty): its blocks are
  dropped (``restarts``), and the new stream is followed from there;
* an undecodable payload (:func:`~prefixkv.wire.kv_events.decode_batch` reads vLLM's map and array
  encodings and SGLang's, per batch) counts as a gap and in ``undecodable``; the first one from
  a worker is logged as a warning naming the worker and the reason (the policy then routes that
  worker on its approximate tree: never silently).

Joining. ZMQ drops what a PUB socket sends before a new subscription reaches it (the "slow
joiner"), and a quiet worker may send nothing after that for a long time. So, once subscribed,
the stream first asks the replay socket (when there is one) for everything still buffered from
sequence 0: a router that starts, or re-discovers a restarted worker, late knows the worker's
blocks at once. Live batches the catch-up already covered are skipped.

**llm-d's topics.** llm-d's vLLM pods publish with the topic ``kv@<ip>:<port>@<model>`` into one
socket their consumer binds (vLLM's "connect" form). Given one ``bind:ADDRESS`` for several
workers, the router binds it once (:class:`SharedEventStream`), reads each message's topic
(:func:`topic_worker`) and hands it to the stream of the worker at that ``ip:port`` (its URL's
host and port; by host alone when one worker has it), each with its own sequence numbers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import zmq
import zmq.asyncio

from prefixkv.wire.kv_events import KVEventBatch, decode_batch
from prefixkv.router.kv_index import ExactIndex

__all__ = ["LLMD_TOPIC", "EventSource", "EventStream", "SharedEventStream", "discover_source",
           "parse_sources", "topic_worker"]

LLMD_TOPIC = "kv@"
"""The prefix of llm-d's per-pod topics, ``kv@<ip>:<port>@<model>``."""

log = logging.getLogger("prefixkv.router")
_END = -1
_JOIN_DELAY = 0.1
"""Seconds for a new subscription to reach the publisher before the catch-up is asked for."""


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where a worker publishes: PUB ``endpoint``, optional ROUTER ``replay_endpoint``, topic.

    With ``bind``, the worker's PUB socket connects out (vLLM's "connect" form) and the router's
    SUB socket binds ``endpoint`` for it (one bound address per worker: the socket names the
    worker); otherwise the router connects to the worker's bound PUB socket.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False
    shared: bool = False  # one bound socket for several workers, told apart by llm-d's topics


async def discover_source(client: httpx.AsyncClient, url: str,
                          timeout: float = 5.0) -> EventSource | None:
    """``url``'s event endpoints from its ``GET /kv_events`` (``None``: it publishes nothing or
    does not answer). Addresses bound on every interface are reached through ``url``'s host."""
    try:
        resp = await client.get(f"{url}/kv_events", timeout=timeout)
        d = resp.json()
        if resp.status_code != 200 or not isinstance(d, dict):
            return None
        host = urlsplit(url).hostname or "127.0.0.1"

        def reach(ep: Any) -> str | None:
            if not isinstance(ep, str):
                return None
            text: str = ep
            for anyhost in ("//0.0.0.0:", "//*:", "//[::]:", "//:::"):
                text = text.replace(anyhost, f"//{host}:")
            return text

        endpoint = reach(d.get("endpoint"))
        topic = d.get("topic", "")
        if endpoint is None or not isinstance(topic, str):
            return None
        return EventSource(endpoint, reach(d.get("replay_endpoint")), topic)
    except (httpx.HTTPError, ValueError):
        return None


class EventStream:
    """Follows ``url``'s events from ``source`` into ``index`` (owns its sockets)."""

    def __init__(self, url: str, source: EventSource, index: ExactIndex,
                 ctx: zmq.asyncio.Context, *, replay_timeout: float = 1.0) -> None:
        self.url = url
        self.source = source
        self._index = index
        self._ctx = ctx
        self._replay_timeout = replay_timeout
        self.last_seq: int | None = None
        self._caught_up_to: int | None = None  # live batches up to here were in the catch-up

    async def run(self) -> None:
        """Subscribe and apply batches until cancelled (a bad frame never ends it)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        mon: zmq.asyncio.Socket | None = None
        try:
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            if self.source.bind:
                await _bind(sub, self.source.endpoint)
                # the worker dials in when it can: each time it connects, catch up from its
                # replay buffer if nothing came yet (what it sent before was dropped)
                mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                poller.register(mon, zmq.POLLIN)
            else:
                sub.connect(self.source.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode("utf-8"))
            await asyncio.sleep(_JOIN_DELAY)
            await self.catch_up()
            while True:
                ready = dict(await poller.poll())
                if mon is not None and mon in ready:
                    await mon.recv_multipart()
                    if self.last_seq is None:
                        await asyncio.sleep(_JOIN_DELAY)
                        await self.catch_up()
                if sub not in ready:
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                await self.receive(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            if mon is not None:
                mon.close(linger=0)
            sub.close(linger=0)

    async def receive(self, seq: int, payload: bytes) -> None:
        """Handle batch ``seq`` as the module docstring says."""
        if self._caught_up_to is not None:
            if seq <= self._caught_up_to:
                return  # applied by the catch-up already
            self._caught_up_to = None
        w = self._index.workers[self.url]
        if self.last_seq is not None and seq <= self.last_seq:
            w.restarts += 1
            self._index.reset(self.url, complete=seq == 0)
            self.last_seq = None
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq > expected:
            missed = await self._replay(expected, seq)
            if missed is None:
                if self.last_seq is not None:
                    w.gaps += 1
                    log.warning("KV events from %s: batches %d..%d lost", self.url, expected,
                                seq - 1)
                self._index.reset(self.url, complete=False)
            else:
                if expected == 0:
                    w.complete = True
                for batch in missed:
                    self._index.apply(self.url, batch)
        elif expected == 0:
            w.complete = True
        try:
            batch = decode_batch(payload)
        except ValueError as exc:
            w.gaps += 1
            w.undecodable += 1
            if w.undecodable == 1:
                log.warning("KV events from %s cannot be read (%s): its exact index is dropped "
                            "and it is routed on its approximate tree until a batch can be "
                            "read", self.url, exc)
            self._index.reset(self.url, complete=False)
        else:
            self._index.apply(self.url, batch)
        self.last_seq = seq

    async def catch_up(self) -> None:
        """Apply what the worker's replay buffer holds from sequence 0 (see "Joining")."""
        got = await self._fetch(0, None)
        if not got:
            return
        seqs = sorted(got)
        w = self._index.workers[self.url]
        if seqs != list(range(seqs[-1] + 1)):  # the buffer no longer reaches back to 0
            self._index.reset(self.url, complete=False)
        else:
            w.complete = True
        for seq in seqs:
            self._index.apply(self.url, got[seq])
        self.last_seq = self._caught_up_to = seqs[-1]

    async def _replay(self, start: int, stop: int) -> list[KVEventBatch] | None:
        """Batches ``start .. stop - 1`` from the replay socket; ``None`` unless all came."""
        got = await self._fetch(start, stop)
        if got is None or sorted(got) != list(range(start, stop)):
            return None
        return [got[s] for s in range(start, stop)]

    async def _fetch(self, start: int, stop: int | None) -> dict[int, KVEventBatch] | None:
        """The replay socket's batches from ``start`` (below ``stop``, if given) by sequence
        number; ``None`` when there is no replay socket or it failed."""
        if self.source.replay_endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: dict[int, KVEventBatch] = {}
        try:
            sock.connect(self.source.replay_endpoint)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self._replay_timeout)
                if len(frames) != 3:
                    return None
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END or (stop is not None and seq >= stop):
                    break
                if seq >= start:
                    got[seq] = decode_batch(frames[2])
        except (TimeoutError, zmq.ZMQError, ValueError):
            return None
        finally:
            sock.close(linger=0)
        return got


def topic_worker(topic: bytes, urls: Sequence[str]) -> str | None:
    """The worker of ``urls`` an llm-d topic ``kv@<ip>:<port>@<model>`` names: the one whose URL
    has that host and port, else the only one with that host; ``None`` if none (or several)."""
    text = topic.decode("utf-8", "replace")
    if not text.startswith(LLMD_TOPIC):
        return None
    addr = text[len(LLMD_TOPIC):].split("@", 1)[0]
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    parts = [(u, urlsplit(u)) for u in urls]
    exact = [u for u, p in parts if p.hostname == host and str(p.port) == port]
    if len(exact) == 1:
        return exact[0]
    by_host = [u for u, p in parts if p.hostname == host]
    return by_host[0] if len(by_host) == 1 else None


class SharedEventStream:
    """One bound SUB socket that several workers' PUB sockets connect to, each publishing under
    llm-d's topic ``kv@<ip>:<port>@<model>``: each message goes to its worker's
    :class:`EventStream` (its own sequence numbers, gaps and counters). A topic naming no known
    worker is logged once and dropped."""

    def __init__(self, source: EventSource, streams: Mapping[str, EventStream],
                 ctx: zmq.asyncio.Context) -> None:
        self.source = source
        self.streams = dict(streams)
        self._ctx = ctx
        self._unknown: set[bytes] = set()

    async def run(self) -> None:
        """Bind, subscribe to ``kv@`` topics and dispatch batches until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            await _bind(sub, self.source.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, (self.source.topic or LLMD_TOPIC).encode("utf-8"))
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                await self.receive(frames[0], int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def receive(self, topic: bytes, seq: int, payload: bytes) -> None:
        """Hand batch ``seq`` to the stream of the worker ``topic`` names."""
        url = topic_worker(topic, list(self.streams))
        if url is None:
            if topic not in self._unknown and len(self._unknown) < 1024:
                self._unknown.add(topic)
                log.warning("KV events under topic %r name no worker of %s: dropped", topic,
                            sorted(self.streams))
            return
        await self.streams[url].receive(seq, payload)


async def _bind(sock: zmq.asyncio.Socket, endpoint: str, tries: int = 40) -> None:
    """Bind ``endpoint``, waiting a little while the address is still in use (a previous
    stream for the same worker closed its socket, and ZMQ releases the port asynchronously)."""
    for attempt in range(tries):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt == tries - 1:
                raise
            await asyncio.sleep(0.05)


def parse_sources(urls: Sequence[str], specs: Sequence[str],
                  topic: str = "") -> dict[str, EventSource | None]:
    """``--kv-events`` values, one per worker (or one for all): ``auto`` (discover: left out of
    the result), ``none`` (publishes nothing), or ``ENDPOINT`` / ``ENDPOINT|REPLAY_ENDPOINT``,
    where ``ENDPOINT`` is the worker's bound PUB address or ``bind:ADDRESS``, an address the
    router binds for a worker whose PUB connects to it (vLLM's "connect" form). One
    ``bind:ADDRESS`` for several workers is one socket for all of them, told apart by llm-d's
    ``kv@<ip>:<port>@<model>`` topics (``shared``)."""
    if not specs:
        return {}
    if len(specs) not in (1, len(urls)):
        raise ValueError(f"kv_events must give one entry per worker ({len(urls)}) or one for "
                         f"all, got {len(specs)}")
    out: dict[str, EventSource | None] = {}
    for url, spec in zip(urls, list(specs) * len(urls) if len(specs) == 1 else specs):
        if spec == "auto":
            continue
        if spec == "none":
            out[url] = None
            continue
        endpoint, _, replay = spec.partition("|")
        bind = endpoint.startswith("bind:")
        endpoint = endpoint.removeprefix("bind:")
        for ep in (endpoint, replay):
            if ep and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events entries are auto, none or tcp://|ipc:// endpoints "
                                 f"('[bind:]ENDPOINT|REPLAY'), got {spec!r}")
        shared = len(specs) == 1 and len(urls) > 1
        if shared and not bind:
            raise ValueError("one kv_events endpoint serves several workers only as "
                             "bind:ADDRESS (their PUB sockets connect to it, llm-d's "
                             "kv@<ip>:<port>@<model> topics name them)")
        if shared and replay:
            raise ValueError("a shared bind: endpoint takes no replay endpoint")
        out[url] = EventSource(endpoint, replay or None, topic, bind, shared)
    return out
