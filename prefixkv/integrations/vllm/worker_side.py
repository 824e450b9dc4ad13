"""WorkerSide: the connector's half in each vLLM worker process: it owns the bytes.

It holds vLLM's per-layer KV tensors (:class:`~prefixkv.integrations.vllm.blocks.KVBlocks`),
the host tier's arena (one row of ``nbytes`` per slot), and the disk and remote tiers
(:class:`DiskTier`, :class:`RemoteTier`, with their writer threads). It runs the scheduler's
:class:`~prefixkv.integrations.vllm.plan.StepPlan`: loads before the forward pass (each block
copied straight from its host row or its read record into vLLM's block), saves after it, on the
save thread (:class:`~prefixkv.integrations.vllm.saver.SaveQueue`: vLLM's step does not wait for
them; finished requests keep their blocks until ``get_finished`` reports their saves done).

Never wrong KV: a load whose host slot holds another key, whose file is corrupt, truncated or
gone, or whose remote read fails, is a load error (its block id is reported, vLLM recomputes
it) and that block is not saved from this step.

Pins (``kv_pin_prefixes``): the first plan carries the pinned keys; the disk tier never evicts
them and the remote tier stores them without expiry (:meth:`RemoteTier.pin`). Disk writes and
drops are collected for the scheduler's KV events (:meth:`WorkerSide.take_disk_changes`), and,
with KV events on, the remote tier's writes and drops (:class:`RemoteWatch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterable, Mapping, Sequence

import torch

from prefixkv.integrations.vllm.blocks import KVBlocks, row_of
from prefixkv.integrations.vllm.config import ConnectorConfig
from prefixkv.integrations.vllm.plan import DISK, GONE, HOST, REMOTE, LoadBlock, SaveBlock, StepPlan
from prefixkv.integrations.vllm.remote_watch import RemoteWatch
from prefixkv.integrations.vllm.saver import SaveQueue
from prefixkv.integrations.vllm.streamed_load import StreamedLoad
from prefixkv.tiers.codec import Payload
from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.pins import PinnedKeys
from prefixkv.tiers.remote import RemoteTier
from prefixkv.tiers.store import DEFAULT_DISK_SIZE
from prefixkv.tiers.spec import parse_size

logger = logging.getLogger("vllm.prefixkv")
REMOTE_BATCH = 64
"""Blocks fetched from the remote tier per round trip."""


class WorkerSide:
    """The tiers' bytes in one worker: arena, disk and remote; runs step plans."""

    def __init__(self, config: ConnectorConfig, host_blocks: int, kv_events: bool = False) -> None:
        self.config = config
        self.host_blocks = host_blocks
        self.kv_events = kv_events
        """vLLM publishes KV events: the remote tier's writes and drops are watched."""
        self.kv: KVBlocks | None = None
        self.arena: torch.Tensor | None = None
        self.slot_keys: list[bytes | None] = []
        self.disk: DiskTier | None = None
        self.remote: RemoteTier | None = None
        self.watch: RemoteWatch | None = None
        self.pinned = PinnedKeys()
        self._remote_pinned: set[bytes] = set()
        self.saver = SaveQueue(self._copy_out)
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="prefixkv-loader")
        self.streamer = ThreadPoolExecutor(1, thread_name_prefix="prefixkv-stream")
        self.streaming: StreamedLoad | None = None
        """This step's remote loads while they stream in (:meth:`end_loads` ends them)."""
        self._recv: dict[str, tuple[Future[set[int]], list[LoadBlock]]] = {}
        """Asynchronous loads in flight, per request."""
        self.failed: set[int] = set()
        self._lock = threading.Lock()  # counts and disk changes: the save / writer threads add
        self.counts: defaultdict[str, float] = defaultdict(float)
        """Since :meth:`take_counts`: ``<tier>_blocks`` / ``_bytes`` / ``_seconds`` loaded,
        ``<tier>_failed_blocks`` and their sum ``failed_blocks``, ``saved_<tier>_blocks``."""
        self.load_times: defaultdict[str, list[float]] = defaultdict(list)
        """Since :meth:`take_counts`: per tier, the seconds of each step's loads from it."""
        self._disk_stored: list[bytes] = []
        self._disk_dropped: list[bytes] = []

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over every layer (0 before :meth:`register`)."""
        return self.kv.nbytes if self.kv is not None else 0

    def register(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        """Take vLLM's per-layer KV tensors (``num_blocks`` blocks each) and open the tiers."""
        self.kv = kv = KVBlocks(kv_caches, num_blocks)
        if self.host_blocks:
            self.arena = torch.empty((self.host_blocks, kv.nbytes), dtype=torch.uint8)
            self.slot_keys = [None] * self.host_blocks
        spec = self.config.spec
        secret = None if spec.remote_secret is None else spec.remote_secret.encode()
        quota = spec.tenant_quotas(None)  # kv_blocks_per_tenant (vLLM's pool has none of ours)
        if spec.disk_dir is not None:
            size = spec.disk_size if spec.disk_size is not None else DEFAULT_DISK_SIZE
            self.disk = DiskTier(spec.disk_dir, parse_size(size, kv.nbytes, "kv_disk_size"),
                                 kv.layout, kv.nbytes, pinned=self.pinned, secret=secret,
                                 tenant_quota=quota["disk"])
            self.disk.on_stored = lambda keys: self._disk_changed(keys, self._disk_stored)
            self.disk.on_drop = lambda keys: self._disk_changed(keys, self._disk_dropped)
        if spec.remote is not None:
            self.remote = RemoteTier(spec.remote, kv.layout, kv.nbytes,
                                     timeout=spec.remote_timeout, ttl=spec.remote_ttl,
                                     secret=secret, tenant_quota=quota["remote"])
            if self.kv_events:
                self.watch = RemoteWatch(self.remote, spec.remote, timeout=spec.remote_timeout)

    # ------------------------------------------------------------------ loads
    def load(self, loads: Sequence[LoadBlock], stream: bool = False) -> set[int]:
        """Copy ``loads`` into vLLM's blocks; returns the block ids that could not be read
        (any thread: the step's, or the loader's for asynchronous loads). With ``stream`` the
        remote loads are left streaming in (:attr:`streaming`, :mod:`.streamed_load`) and
        their failures join :attr:`failed` at :meth:`end_loads`."""
        kv = self.kv
        assert kv is not None
        failed: set[int] = set()
        remote = [ld for ld in loads if ld.tier == REMOTE]
        streamed = None
        if remote and self.remote is not None and kv.direct:
            streamed = StreamedLoad(self.remote, kv, remote)
            if stream:  # first: it overlaps the host and disk copies
                streamed.start(self.streamer)
        host = [ld for ld in loads if ld.tier in (HOST, GONE)]
        if host:
            t0 = time.perf_counter()
            self.saver.wait()  # a slot filled by an earlier step's save is read after its copy
            for ld in host:
                if self.arena is not None and ld.slot is not None and ld.tier == HOST \
                        and self.slot_keys[ld.slot] == ld.key:
                    kv.write(ld.block_id, self.arena[ld.slot])
                else:
                    failed.add(ld.block_id)
            self._count(HOST, host, failed, time.perf_counter() - t0)
        disk = [ld for ld in loads if ld.tier == DISK]
        if disk:
            t0 = time.perf_counter()
            for ld in disk:
                self._write_payload(ld.block_id, self.disk.read(ld.key) if self.disk else None,
                                    failed)
            self._count(DISK, disk, failed, time.perf_counter() - t0)
        if streamed is not None and stream:
            self.streaming = streamed
        elif streamed is not None:  # on this thread, all before returning
            self._remote_done(streamed.loads, streamed.run(), failed, streamed.seconds)
        elif remote:  # vLLM's blocks are not plain host memory: whole records, then copies
            t0 = time.perf_counter()
            got: list[Payload | None] = []
            for i in range(0, len(remote), REMOTE_BATCH):
                keys = [ld.key for ld in remote[i : i + REMOTE_BATCH]]
                got += self.remote.read_many(keys) if self.remote else [None] * len(keys)
            for ld, payload in zip(remote, got):
                self._write_payload(ld.block_id, payload, failed)
            self._remote_done(remote, [p is not None for p in got], failed,
                              time.perf_counter() - t0)
        with self._lock:
            self.counts["failed_blocks"] += len(failed)
        return failed

    def _remote_done(self, loads: Sequence[LoadBlock], ok: Sequence[bool], failed: set[int],
                     seconds: float) -> None:
        """Count remote ``loads`` (``ok``: which arrived good; the others join ``failed``)."""
        failed.update(ld.block_id for ld, good in zip(loads, ok) if not good)
        if self.watch is not None and self.remote is not None and self.remote.is_up:
            # the server answered: a miss is a block it no longer holds
            self.watch.missing([ld.key for ld, good in zip(loads, ok) if not good])
        self._count(REMOTE, loads, failed, seconds)

    def wait_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: the streaming remote loads of ``layer_name`` are in
        place on return."""
        if self.streaming is not None:
            self.streaming.wait_layer(layer_name)

    def end_loads(self) -> None:
        """The step's forward pass is over: wait for the streamed remote loads to end; the
        blocks that failed them join :attr:`failed` (reported to vLLM this step)."""
        streamed, self.streaming = self.streaming, None
        if streamed is None:
            return
        failed: set[int] = set()
        self._remote_done(streamed.loads, streamed.finish(), failed, streamed.seconds)
        self.failed |= failed
        with self._lock:
            self.counts["failed_blocks"] += len(failed)
            self.counts["remote_wait_seconds"] += streamed.waited

    def _write_payload(self, block_id: int, payload: Payload | None, failed: set[int]) -> None:
        """Copy a read record's payload into vLLM's block, or note the failure."""
        assert self.kv is not None
        if payload is None or len(payload) != self.kv.nbytes:
            failed.add(block_id)
        else:
            self.kv.write(block_id, row_of(payload))

    def _count(self, tier: str, loads: Sequence[LoadBlock], failed: set[int],
               seconds: float) -> None:
        """Count ``loads`` from ``tier`` (those in ``failed`` did not load) and their time."""
        bad = sum(ld.block_id in failed for ld in loads)
        good = len(loads) - bad
        with self._lock:
            self.counts[f"{tier}_blocks"] += good
            self.counts[f"{tier}_bytes"] += good * self.block_nbytes
            self.counts[f"{tier}_seconds"] += seconds
            self.counts[f"{tier}_failed_blocks"] += bad
            self.load_times[tier].append(seconds)

    # ------------------------------------------------------------------ saves
    def save(self, saves: Sequence[SaveBlock]) -> None:
        """Queue ``saves`` (blocks computed by now) for the save thread; blocks that failed to
        load this step are skipped (the streamed loads are ended first)."""
        self.end_loads()
        todo = [s for s in saves if s.block_id not in self.failed]
        self.saver.submit(saves, todo)

    def _copy_out(self, saves: Sequence[SaveBlock]) -> None:
        """On the save thread: host rows filled, disk and remote records queued."""
        kv, arena, disk, remote = self.kv, self.arena, self.disk, self.remote
        assert kv is not None
        scratch: torch.Tensor | None = None
        host = to_disk_n = 0
        wrote: list[bytes] = []  # queued for the remote tier (the watch confirms them)
        for s in saves:
            pinned = s.key in self.pinned
            to_disk = disk is not None and not disk.contains(s.key)
            to_remote = remote is not None and (
                not remote.is_known(s.key) or (pinned and s.key not in self._remote_pinned))
            if s.slot is not None and arena is not None:
                row = arena[s.slot]
                self.slot_keys[s.slot] = None  # being overwritten
                kv.read(s.block_id, row)
                self.slot_keys[s.slot] = s.key
                host += 1
            elif to_disk or to_remote:
                if scratch is None:
                    scratch = torch.empty(kv.nbytes, dtype=torch.uint8)
                row = scratch
                kv.read(s.block_id, row)
            else:
                continue
            if not (to_disk or to_remote):
                continue
            payload = row.numpy().tobytes()
            if to_disk:
                disk.submit(s.key, payload, s.tenant)  # type: ignore[union-attr]
                to_disk_n += 1
            if to_remote and pinned:
                if remote.pin([s.key], [payload]):  # type: ignore[union-attr]
                    self._remote_pinned.add(s.key)
                    wrote.append(s.key)
            elif to_remote:
                remote.submit(s.key, payload, s.tenant)  # type: ignore[union-attr]
                wrote.append(s.key)
        if wrote and self.watch is not None:
            self.watch.wrote(wrote)
        with self._lock:
            self.counts["saved_host_blocks"] += host
            self.counts["saved_disk_blocks"] += to_disk_n
            self.counts["saved_remote_blocks"] += len(wrote)

    # ------------------------------------------------------------------ a step
    def run_loads(self, plan: StepPlan) -> None:
        """Start of a step: pins (first plan), this step's loads (load errors reset)."""
        self.end_loads()  # a step whose end vLLM never signalled
        if plan.pins:
            self.pinned.clear()
            self.pinned.add(plan.pins)
        self.failed = set()
        if plan.loads:
            self.failed = self.load(plan.loads, stream=True)
        by_request: dict[str, list[LoadBlock]] = {}
        for ld in plan.recv:
            by_request.setdefault(ld.req_id, []).append(ld)
        for rid, loads in by_request.items():  # in order, on the loader thread
            self._recv[rid] = (self.loader.submit(self.load, loads), loads)

    def preempted(self, plan: StepPlan) -> None:
        """vLLM's ``handle_preemptions``: freed blocks may be reused this step, so every
        queued copy finishes first."""
        if plan.preempted:
            self.saver.wait()

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """vLLM's ``get_finished``: (the finished requests whose saves are all copied, the
        requests whose asynchronous loads are done). The blocks those loads could not read
        join this step's :attr:`failed` (vLLM wants them no later than the request)."""
        recving = {rid for rid, (job, _) in self._recv.items() if job.done()}
        for rid in recving:
            job, loads = self._recv.pop(rid)
            if job.exception() is None:
                self.failed |= job.result()
            else:  # a failed load job: all of its blocks are recomputed
                logger.warning("prefixkv: a load failed (%s); its blocks are recomputed",
                               job.exception())
                self.failed |= {ld.block_id for ld in loads}
        return self.saver.finished(finished_req_ids), recving

    def _disk_changed(self, keys: list[bytes], into: list[bytes]) -> None:
        with self._lock:
            into.extend(keys)

    def take_disk_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Keys the disk tier wrote, and keys it dropped (evicted, cleared, found corrupt),
        since the last call (for the scheduler's KV events)."""
        with self._lock:
            out = (self._disk_stored, self._disk_dropped)
            self._disk_stored, self._disk_dropped = [], []
            return out

    def take_remote_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Keys this worker wrote to the remote tier (confirmed on the server) and keys of
        those the server dropped since (expired, evicted, deleted, or missing at a load), since
        the last call; empty unless KV events are on."""
        return self.watch.take() if self.watch is not None else ([], [])

    def take_counts(self) -> dict[str, float | list[float]]:
        """The counters since the last call (then reset), with ``<tier>_load_times``."""
        with self._lock:
            out: dict[str, float | list[float]] = dict(self.counts)
            out.update((f"{tier}_load_times", times) for tier, times in self.load_times.items())
            self.counts, self.load_times = defaultdict(float), defaultdict(list)
            return out

    def take_failed(self) -> set[int]:
        """Block ids that failed to load this step (reported once)."""
        out, self.failed = self.failed, set()
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued copies and disk / remote writes; ``False`` on timeout."""
        ok = self.saver.wait(timeout)
        for tier in (self.disk, self.remote):
            if tier is not None:
                ok = tier.flush(timeout) and ok
        return ok

    def close(self) -> None:
        """Finish the loads and copies, flush and stop the writer threads (idempotent)."""
        self.end_loads()
        self.loader.shutdown(wait=True)
        self.streamer.shutdown(wait=True)
        self.saver.close()
        if self.watch is not None:
            self.watch.close()
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.close()
