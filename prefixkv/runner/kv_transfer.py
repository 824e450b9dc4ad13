"""KV block transfer between the pool and host memory, and the model fingerprint.

:class:`KVTransfer` implements ``prefixkv.tiers.BlockTransfer`` for a :class:`KVPool`: a block
is ``kv[:, :, block_id]`` (K and V of every layer, ``[2, layers, block_size, kv_heads,
head_dim]``). The host arena holds ``host_blocks`` such blocks in one tensor, pinned when the
pool is on CUDA (so copies can run as DMA). Ownership: the arena belongs to this object; which
key lives in which slot is the host tier's bookkeeping (``prefixkv.tiers.host``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from prefixkv.runner.kv_pool import KVPool

_SAMPLE = 4096
"""Values sampled per weight tensor for the fingerprint."""


class KVTransfer:
    """Moves whole KV blocks: pool <-> host arena slots, pool <-> raw bytes."""

    def __init__(self, pool: KVPool, host_blocks: int = 0) -> None:
        if host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {host_blocks}")
        self.pool = pool
        kv = pool.kv
        self._shape = (2, pool.num_layers, pool.block_size, pool.num_kv_heads, pool.head_dim)
        self._dtype = kv.dtype
        pin = kv.device.type == "cuda"
        self.host = torch.empty((host_blocks, *self._shape), dtype=kv.dtype, pin_memory=pin)

    @property
    def layout(self) -> str:
        """dtype and block shape, e.g. ``float32:2x4x16x2x64``."""
        return f"{str(self._dtype).removeprefix('torch.')}:" + "x".join(map(str, self._shape))

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block."""
        n = 1
        for d in self._shape:
            n *= d
        return n * self.pool.kv.element_size()

    @property
    def host_nbytes(self) -> int:
        """Bytes held by the host arena."""
        return self.host.numel() * self.host.element_size()

    def to_host(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy pool blocks into arena slots (one each, same order)."""
        with torch.inference_mode():
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.pool.kv.device)
            blocks = self.pool.kv.index_select(2, ids).movedim(2, 0)
            self.host[torch.tensor(list(slots), dtype=torch.long)] = blocks.to("cpu")

    def from_host(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy arena slots into pool blocks (one each, same order)."""
        with torch.inference_mode():
            data = self.host[torch.tensor(list(slots), dtype=torch.long)]
            data = data.to(self.pool.kv.device, non_blocking=True).movedim(0, 2)
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.pool.kv.device)
            self.pool.kv.index_copy_(2, ids, data)

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each pool block's raw bytes (C order of ``[2, layers, block_size, heads, dim]``)."""
        with torch.inference_mode():
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.pool.kv.device)
            blocks = self.pool.kv.index_select(2, ids).movedim(2, 0).contiguous().cpu()
            raw = blocks.view(torch.uint8).reshape(len(block_ids), -1).numpy()
            return [row.tobytes() for row in raw]

    def write_block(self, block_id: int, data: bytes) -> None:
        """Overwrite one pool block with bytes from :meth:`read_blocks`."""
        if len(data) != self.block_nbytes:
            raise ValueError(f"block data is {len(data)} bytes, expected {self.block_nbytes}")
        with torch.inference_mode():
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self._dtype)
            self.pool.kv[:, :, block_id] = t.reshape(self._shape).to(self.pool.kv.device)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A process-independent digest of the model's weights (names, shapes, dtypes and a fixed
    sample of up to 4096 values of each tensor): equal weights give equal fingerprints on any
    machine; another checkpoint of the same architecture almost surely differs."""
    h = hashlib.sha256()
    with torch.inference_mode():
        for name, t in sorted(model.state_dict().items()):
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLE)
            sample = flat[::step][:_SAMPLE].to("cpu", torch.float32)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]
