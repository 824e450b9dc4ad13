"""StreamedLoad: one step's Valkey loads, arriving layer by layer while vLLM's forward pass runs.

vLLM calls ``wait_for_layer_load(layer)`` before each attention layer. Loading every block
before the pass (as the host and disk tiers do, in a few milliseconds) would make the step wait
for the whole transfer: ~15 blocks of 5.9 MB through valkey-server and a socket. Instead the
remote loads of a step are one :class:`~prefixkv.tiers.range_read.StreamedRead`, cut into
:data:`PIECES` runs of whole layers, received on its own thread straight into vLLM's blocks
(:meth:`KVBlocks.buffers`); layer ``L`` waits only for its piece of every block, so the
transfer of later layers overlaps the computing of earlier ones.

Ownership: from :meth:`StreamedLoad.start` until :meth:`StreamedLoad.finish` the loaded
blocks' memory is written by the read's threads; vLLM reads a layer of them only after its
wait. The records' checksums (and MACs) are known only at :meth:`finish` (end of the step,
before vLLM asks for load errors): a block that fails them is reported, vLLM recomputes it and
drops what this step produced from it; no step after this one sees its bytes as KV.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from prefixkv.integrations.vllm.blocks import KVBlocks
from prefixkv.integrations.vllm.plan import LoadBlock
from prefixkv.tiers.remote import RemoteTier

PIECES = 8
"""Runs of layers a streamed block is read in (SmolLM2's 30 layers: pieces of 3 or 4)."""


class StreamedLoad:
    """``loads`` (all from ``remote``, into ``kv``'s blocks; ``kv.direct``) streaming in."""

    def __init__(self, remote: RemoteTier, kv: KVBlocks, loads: Sequence[LoadBlock]) -> None:
        self.loads = list(loads)
        cuts, self._piece_of = kv.cuts(PIECES)
        self._index = kv.index
        self.read = remote.streamed(
            [ld.key for ld in self.loads], cuts,
            lambda i, g: kv.buffers(self.loads[i].block_id, cuts[g], cuts[g + 1]))
        self._remote = remote
        self._job: Future[list[bool]] | None = None
        self.started = 0.0
        self.seconds = 0.0
        """The transfer's own time (start to last byte checked)."""
        self.waited = 0.0
        """Seconds the forward pass spent waiting for layers."""

    def start(self, pool: ThreadPoolExecutor) -> None:
        """Begin the transfer on ``pool``'s thread."""
        self.started = time.perf_counter()
        self._job = pool.submit(self._run)

    def run(self) -> list[bool]:
        """The whole transfer on this thread instead (nobody waits for layers): per load,
        whether its block arrived whole and good."""
        self.started = time.perf_counter()
        return self._run()

    def _run(self) -> list[bool]:
        try:
            return self._remote.read_streamed(self.read)
        finally:
            self.seconds = time.perf_counter() - self.started

    def wait_layer(self, layer_name: str) -> None:
        """Block until ``layer_name``'s piece of every block is in place (or the read ended);
        a layer the blocks do not hold returns at once."""
        layer = self._index.get(layer_name)
        if layer is not None:
            t0 = time.perf_counter()
            self.read.wait(self._piece_of[layer])
            self.waited += time.perf_counter() - t0

    def finish(self) -> list[bool]:
        """Wait for the end of the transfer: per load, whether its block arrived whole and
        good (a read that raised fails every block)."""
        assert self._job is not None
        try:
            return self._job.result()
        except Exception:  # noqa: BLE001 - read_streamed counts its own failures; be safe
            self.read.abandon()
            return [False] * len(self.loads)
