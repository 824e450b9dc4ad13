"""WorkerSide: the connector's half in each vLLM worker process: it owns the bytes.

It holds vLLM's per-layer KV tensors (registered once), the host tier's arena (one row of
``block_nbytes`` per slot), and the disk and remote tiers (:class:`DiskTier`,
:class:`RemoteTier`, with their writer threads). It runs the scheduler's
:class:`~prefixkv.integrations.vllm.plan.StepPlan`: loads before the forward pass, saves after
it. A block's bytes are its slice of every layer's tensor, layer after layer (any layout whose
block index is one dimension: vLLM's CPU ``[blocks, kv_heads, block_size, 2*head_dim]``, GPU
``[2, blocks, ...]``).

Never wrong KV: a load whose host slot holds another key, whose file is corrupt, truncated or
gone, or whose remote read fails, is a load error (its block id is reported, vLLM recomputes
it) and that block is not saved from this step.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch

from prefixkv.integrations.vllm.config import ConnectorConfig
from prefixkv.integrations.vllm.plan import DISK, HOST, REMOTE, LoadBlock, SaveBlock, StepPlan
from prefixkv.tiers.disk import DiskTier
from prefixkv.tiers.remote import RemoteTier
from prefixkv.tiers.store import DEFAULT_DISK_SIZE
from prefixkv.tiers.spec import parse_size

REMOTE_BATCH = 64
"""Blocks fetched from the remote tier per round trip."""


class WorkerSide:
    """The tiers' bytes in one worker: arena, disk and remote; runs step plans."""

    def __init__(self, config: ConnectorConfig, host_blocks: int) -> None:
        self.config = config
        self.host_blocks = host_blocks
        self.views: list[torch.Tensor] = []  # per layer: [num_blocks, ...] (a view of vLLM's)
        self.sizes: list[int] = []  # per layer: bytes of one block
        self.layout = ""
        self.block_nbytes = 0
        self.arena: torch.Tensor | None = None
        self.slot_keys: list[bytes | None] = []
        self.disk: DiskTier | None = None
        self.remote: RemoteTier | None = None
        self.failed: set[int] = set()
        self.counts: defaultdict[str, float] = defaultdict(float)
        """Since :meth:`take_counts`: ``<tier>_blocks`` / ``_bytes`` / ``_seconds`` loaded,
        ``failed_blocks``, ``saved_<host|lower>_blocks``."""

    def register(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        """Take vLLM's per-layer KV tensors (``num_blocks`` blocks each) and open the tiers."""
        seen: set[int] = set()
        shapes = []
        for name, t in kv_caches.items():
            if t.data_ptr() in seen:  # layers sharing one cache are stored once
                continue
            seen.add(t.data_ptr())
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"prefixkv connector: layer {name} has KV shape {tuple(t.shape)}"
                                 f" with no dimension of {num_blocks} blocks")
            view = t.movedim(dims[0], 0)
            self.views.append(view)
            self.sizes.append(view[0].numel() * view.element_size())
            shapes.append(f"{dims[0]}:{'x'.join(map(str, view.shape[1:]))}")
        dtype = str(self.views[0].dtype).removeprefix("torch.")
        self.layout = f"vllm/{dtype}/{len(self.views)}x" + ",".join(sorted(set(shapes)))
        self.block_nbytes = sum(self.sizes)
        if self.host_blocks:
            self.arena = torch.empty((self.host_blocks, self.block_nbytes), dtype=torch.uint8)
            self.slot_keys = [None] * self.host_blocks
        spec = self.config.spec
        secret = None if spec.remote_secret is None else spec.remote_secret.encode()
        if spec.disk_dir is not None:
            size = spec.disk_size if spec.disk_size is not None else DEFAULT_DISK_SIZE
            self.disk = DiskTier(spec.disk_dir, parse_size(size, self.block_nbytes, "kv_disk_size"),
                                 self.layout, self.block_nbytes, secret=secret)
        if spec.remote is not None:
            self.remote = RemoteTier(spec.remote, self.layout, self.block_nbytes,
                                     timeout=spec.remote_timeout, ttl=spec.remote_ttl, secret=secret)

    # ------------------------------------------------------------------ bytes
    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The bytes of vLLM blocks ``block_ids``: ``[n, block_nbytes]`` uint8 (a copy)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        parts = [v.index_select(0, ids).reshape(len(ids), -1).view(torch.uint8)
                 for v in self.views]
        return torch.cat(parts, dim=1)

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write rows of ``data`` (``[n, block_nbytes]`` uint8) into vLLM blocks ``block_ids``."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        off = 0
        for view, size in zip(self.views, self.sizes):
            part = data[:, off : off + size].contiguous().view(view.dtype)
            view.index_copy_(0, ids, part.reshape(len(ids), *view.shape[1:]))
            off += size

    # ------------------------------------------------------------------ a step
    def load(self, loads: Sequence[LoadBlock]) -> None:
        """Copy ``loads`` into vLLM's blocks; the ones that cannot be read go to :attr:`failed`."""
        rows: list[tuple[int, torch.Tensor]] = []
        t0 = time.perf_counter()
        host = [ld for ld in loads if ld.tier == HOST]
        if host and self.arena is not None:
            good = [ld for ld in host if ld.slot is not None and self.slot_keys[ld.slot] == ld.key]
            self.failed.update(ld.block_id for ld in host if ld not in good)
            if good:
                slots = torch.tensor([ld.slot for ld in good], dtype=torch.long)
                self.scatter([ld.block_id for ld in good], self.arena.index_select(0, slots))
                self._count(HOST, len(good), t0)
        else:
            self.failed.update(ld.block_id for ld in host)
        payloads: list[tuple[int, bytes | None]] = []
        t0 = time.perf_counter()
        for ld in loads:
            if ld.tier == DISK:
                payloads.append((ld.block_id, self.disk.read(ld.key) if self.disk else None))
            elif ld.tier not in (HOST, REMOTE):
                payloads.append((ld.block_id, None))
        self._count(DISK, sum(p is not None for _, p in payloads), t0)
        t0 = time.perf_counter()
        remote = [ld for ld in loads if ld.tier == REMOTE]
        for i in range(0, len(remote), REMOTE_BATCH):
            batch = remote[i : i + REMOTE_BATCH]
            got = self.remote.read_many([ld.key for ld in batch]) if self.remote else \
                [None] * len(batch)
            payloads.extend((ld.block_id, p) for ld, p in zip(batch, got))
        self._count(REMOTE, sum(p is not None for _, p in payloads[len(payloads) - len(remote):]), t0)
        for block_id, payload in payloads:
            if payload is None or len(payload) != self.block_nbytes:
                self.failed.add(block_id)
            else:
                rows.append((block_id, _read_only_bytes(payload)))
        if rows:  # stack copies the payloads: they are only read
            self.scatter([b for b, _ in rows], torch.stack([r for _, r in rows]))
        self.counts["failed_blocks"] += len(self.failed)

    def _count(self, tier: str, blocks: int, since: float) -> None:
        if blocks:
            self.counts[f"{tier}_blocks"] += blocks
            self.counts[f"{tier}_bytes"] += blocks * self.block_nbytes
            self.counts[f"{tier}_seconds"] += time.perf_counter() - since

    def save(self, saves: Sequence[SaveBlock]) -> None:
        """Store ``saves`` (blocks computed by now): host rows at once, disk and remote
        records queued for their writer threads. Blocks that failed to load are skipped."""
        saves = [s for s in saves if s.block_id not in self.failed]
        disk, remote = self.disk, self.remote
        lower = [s for s in saves
                 if (disk is not None and not disk.contains(s.key))
                 or (remote is not None and not remote.is_known(s.key))]
        host = [s for s in saves if s.slot is not None and self.arena is not None]
        todo = list({s.block_id: s for s in host + lower}.values())
        if not todo:
            return
        data = self.gather([s.block_id for s in todo])
        row = {s.block_id: i for i, s in enumerate(todo)}
        if host and self.arena is not None:
            slots = torch.tensor([s.slot for s in host], dtype=torch.long)
            self.arena.index_copy_(0, slots, data[[row[s.block_id] for s in host]])
            for s in host:
                self.slot_keys[s.slot] = s.key  # type: ignore[index]
            self.counts["saved_host_blocks"] += len(host)
        self.counts["saved_lower_blocks"] += len(lower)
        for s in lower:
            payload = data[row[s.block_id]].numpy().tobytes()
            if disk is not None:
                disk.submit(s.key, payload)
            if remote is not None:
                remote.submit(s.key, payload)

    def run_loads(self, plan: StepPlan) -> None:
        """Start of a step: this step's loads (load errors reset)."""
        self.failed = set()
        if plan.loads:
            self.load(plan.loads)

    def take_counts(self) -> dict[str, float]:
        """The counters since the last call (then reset)."""
        out, self.counts = dict(self.counts), defaultdict(float)
        return out

    def take_failed(self) -> set[int]:
        """Block ids that failed to load this step (reported once)."""
        out, self.failed = self.failed, set()
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for queued disk / remote writes; ``False`` on timeout."""
        ok = True
        for tier in (self.disk, self.remote):
            if tier is not None:
                ok = tier.flush(timeout) and ok
        return ok

    def close(self) -> None:
        """Flush and stop the writer threads (idempotent)."""
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.close()


def _read_only_bytes(payload: bytes) -> torch.Tensor:
    """A uint8 view of ``payload`` without a copy (the caller never writes it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": never written
        return torch.frombuffer(payload, dtype=torch.uint8)
