"""The ZMQ transport of KV events, as vLLM's ``ZmqEventPublisher`` speaks it.

* PUB socket: each batch is three frames ``(topic, seq, payload)``: ``seq`` counts batches from
  0 as an 8-byte big-endian int (a subscriber that sees a jump missed batches; a smaller number
  means the worker restarted), ``payload`` is the msgpack :class:`KVEventBatch` in the config's
  ``encoding`` (vLLM 0.32's map events by default).
* Where: with no ``endpoint`` the PUB socket binds loopback port 5557 only; ``tcp://*:5557``
  exposes it on every interface (see :class:`KVEventsConfig`).
* Optional ROUTER socket (replay): a request ``(identity, b"", start_seq)`` is answered with
  ``(identity, b"", seq, payload)`` for every buffered batch from ``start_seq`` on (the last
  ``buffer_steps``), then ``(identity, b"", -1 as 8 signed bytes, b"")``.

Sockets are made (bound or connected) in the constructor, so a busy port is an error at start,
and used only from the event sink's thread afterwards. :func:`make_kv_event_sink` builds the
whole worker side from a :class:`KVEventsConfig`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec
import zmq

from prefixkv.engine.kv_events import KVEventSink
from prefixkv.wire.kv_events import KVEventBatch, KVEventsConfig, encode_batch

__all__ = ["END_SEQ", "ZmqEventPublisher", "make_kv_event_sink"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """PUB (+ optional ROUTER replay) sockets with a replay buffer; owns its ZMQ context.

    ``endpoint`` / ``replay_endpoint`` are the addresses actually bound (a ``*`` port resolved),
    for subscribers to connect to.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        self._ctx = zmq.Context()
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self.encoding = config.encoding
        address, binds = config.address
        self._seq = 0
        self._replay: zmq.Socket[bytes] | None = None
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds:
                self._pub.bind(address)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(address)
                self.endpoint = address
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"KV events: cannot open {address!r}"
                          f"{f' / {config.replay_endpoint!r}' if config.replay_endpoint else ''}:"
                          f" {exc}") from None
        self.topic = config.topic

    def send(self, batch: KVEventBatch) -> None:
        """Publish ``batch`` under the next sequence number and keep it for replay."""
        payload = encode_batch(batch, self.encoding, self._encoder)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def service(self) -> None:
        """Answer every replay request waiting on the ROUTER socket (malformed ones ignored)."""
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        """Close the sockets and the context. Idempotent."""
        if self._ctx.closed:
            return
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def make_kv_event_sink(config: KVEventsConfig | str | dict[str, Any],
                       block_size: int) -> KVEventSink | None:
    """The engine's event sink publishing over ZMQ as ``config`` (vLLM's JSON, a dict or a
    :class:`KVEventsConfig`) says; ``None`` if disabled. ``ValueError`` for a bad config,
    ``OSError`` when a socket cannot be bound."""
    config = KVEventsConfig.parse(config)
    if not config.enabled:
        return None
    return KVEventSink(block_size, ZmqEventPublisher(config),
                       max_queue_size=config.max_queue_size)
