"""KV block transfer between the pool and host memory, and the model fingerprint.

:class:`KVTransfer` implements ``prefixkv.tiers.BlockTransfer`` for a :class:`KVPool`: a block
is ``kv[:, :, block_id]`` (K and V of every layer, ``[2, layers, block_size, kv_heads,
head_dim]``). The host arena holds ``host_blocks`` such blocks in one tensor, pinned when the
pool is on CUDA (so copies can run as DMA). Ownership: the arena belongs to this object; which
key lives in which slot is the host tier's bookkeeping (``prefixkv.tiers.host``).

On CUDA, pool <-> arena copies run on a side stream and never block the CPU: an offload
(:meth:`KVTransfer.to_host`) starts after the model's queued writes to those blocks (the side
stream waits for the compute stream) and the compute stream waits, on the GPU, for the copy
before its next kernel, which may overwrite the freed blocks; a load (:meth:`KVTransfer.from_host`)
is ordered the same way, so the next step reads the loaded KV. The CPU never touches the arena
between, so no host-side wait is needed. :meth:`KVTransfer.read_blocks` (bytes for disk and
the remote tier) waits for its own copies only. On CPU every copy is synchronous.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Iterator, Sequence

import torch

from prefixkv.models.llama import CausalLM
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
        self._stream = torch.cuda.Stream(kv.device) if pin else None  # type: ignore[no-untyped-call]

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
        """Copy pool blocks into arena slots (one each, same order); the blocks may be reused
        as soon as this returns (on CUDA the compute stream waits for the copy)."""
        kv, host = self.pool.kv, self.host
        with torch.inference_mode(), self._side() as side:
            for b, s in zip(block_ids, slots):  # per-block strided copies beat a gather here
                host[s].copy_(kv[:, :, b], non_blocking=side)

    def from_host(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy arena slots into pool blocks (one each, same order), ready for the next step."""
        kv, host = self.pool.kv, self.host
        with torch.inference_mode(), self._side() as side:
            for s, b in zip(slots, block_ids):
                kv[:, :, b].copy_(host[s], non_blocking=side)

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each pool block's raw bytes (C order of ``[2, layers, block_size, heads, dim]``)."""
        kv = self.pool.kv
        with torch.inference_mode():
            out = torch.empty((len(block_ids), *self._shape), dtype=kv.dtype,
                              pin_memory=self._stream is not None)
            with self._side() as side:
                for i, b in enumerate(block_ids):
                    out[i].copy_(kv[:, :, b], non_blocking=side)
            if self._stream is not None:
                self._stream.synchronize()  # these copies (and what they waited for) only
            raw = out.view(torch.uint8).reshape(len(block_ids), -1).numpy()
            return [row.tobytes() for row in raw]

    @contextlib.contextmanager
    def _side(self) -> Iterator[bool]:
        """Run the copies in the block on the side stream, ordered after the compute stream's
        queued work, and make the compute stream wait for them; yields whether copies may be
        asynchronous (``False`` on CPU: nothing to order)."""
        stream = self._stream
        if stream is None:
            yield False
            return
        compute = torch.cuda.current_stream(stream.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            yield True
        compute.wait_stream(stream)

    def write_block(self, block_id: int, data: bytes | bytearray) -> None:
        """Overwrite one pool block with bytes from :meth:`read_blocks` (``data`` is only read)."""
        if len(data) != self.block_nbytes:
            raise ValueError(f"block data is {len(data)} bytes, expected {self.block_nbytes}")
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: never written
            t = torch.frombuffer(data, dtype=torch.uint8).view(self._dtype).reshape(self._shape)
            self.pool.kv[:, :, block_id].copy_(t)


def model_fingerprint(model: CausalLM | torch.nn.Module) -> str:
    """A process-independent digest of the model's weights (names, shapes, dtypes and a fixed
    sample of up to 4096 values of each tensor): equal weights give equal fingerprints on any
    machine; another checkpoint of the same architecture almost surely differs. It reads the
    values, so take it before ``pack_weights()`` (the runner keeps it as ``fingerprint``);
    ``ValueError`` for a model whose plain weights were already dropped."""
    h = hashlib.sha256()
    with torch.inference_mode():
        for name, t in sorted(model.state_dict().items()):
            if t.is_meta:
                raise ValueError(f"model_fingerprint: {name} has no data (weights packed)")
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLE)
            sample = flat[::step][:_SAMPLE].to("cpu", torch.float32)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]
