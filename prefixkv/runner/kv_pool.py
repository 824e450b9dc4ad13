"""The paged KV storage: one tensor holding K and V of every layer, split into blocks.

Ownership: the pool only holds tensors. Which block belongs to which sequence is the engine's
business (its ``BlockPool`` and the prefix index); the pool never allocates or frees ids.
Slot ``block_id * block_size + row`` of a layer holds the K/V of one token.
"""

from __future__ import annotations

import torch


class KVPool:
    """``num_blocks`` blocks of ``block_size`` token slots for every layer, K and V.

    Storage is a single zero-initialised tensor ``[2, num_layers, num_blocks, block_size,
    num_kv_heads, head_dim]`` on ``device`` in ``dtype`` (zeros keep never-written slots finite,
    so masked attention over padding cannot produce NaN).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv = torch.zeros(
            (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )
        # each layer's (k, v) views, made once: indexing costs ~3 us a layer per step
        self._layers = [(self.kv[0, i], self.kv[1, i]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block occupies across all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @property
    def nbytes(self) -> int:
        """Total bytes held by the pool."""
        return self.kv.numel() * self.kv.element_size()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(k, v)`` of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self._layers[layer_idx]

    def copy_rows(self, src_block: int, dst_block: int, num_rows: int) -> None:
        """Copy the first ``num_rows`` token slots of ``src_block`` into ``dst_block``, all layers.

        Used for partial-block prefix reuse: the destination's remaining rows are left as they
        are (the caller computes them next). ``src_block == dst_block`` is a no-op.
        """
        for name, block in (("src_block", src_block), ("dst_block", dst_block)):
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"{name}={block} out of range [0, {self.num_blocks})")
        if not 0 <= num_rows <= self.block_size:
            raise ValueError(f"num_rows={num_rows} out of range [0, {self.block_size}]")
        if num_rows == 0 or src_block == dst_block:
            return
        self.kv[:, :, dst_block, :num_rows] = self.kv[:, :, src_block, :num_rows]
