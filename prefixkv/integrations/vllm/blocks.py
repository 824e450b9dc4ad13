"""KVBlocks: one vLLM block's bytes across every layer, copied in and out of vLLM's KV tensors.

A block's stored form is one row of ``nbytes`` uint8: its slice of each layer's tensor, layer
after layer, each slice in that tensor's own element order. Any layout whose block index is one
dimension works (vLLM's CPU ``[blocks, kv_heads, block_size, 2*head_dim]``, GPU
``[2, blocks, ...]``). Each copy goes straight between vLLM's block and the row (one memory
copy per layer, no intermediate tensors): for SmolLM2's 30 layers a 2.9 MB block moves in about
0.5 ms on one core.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch


class KVBlocks:
    """Views of vLLM's per-layer KV tensors with the block index first."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        """Take vLLM's per-layer KV tensors (``num_blocks`` blocks each); ``ValueError`` for a
        layer with no dimension of ``num_blocks``."""
        seen: dict[int, int] = {}
        shapes = []
        self.views: list[torch.Tensor] = []
        self.offsets: list[tuple[int, int]] = []  # per layer: (start, end) within a row
        self.index: dict[str, int] = {}
        """Layer name -> its view (layers sharing one cache share it)."""
        off = 0
        for name, t in kv_caches.items():
            if t.data_ptr() in seen:  # layers sharing one cache are stored once
                self.index[name] = seen[t.data_ptr()]
                continue
            self.index[name] = seen[t.data_ptr()] = len(self.views)
            dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"prefixkv connector: layer {name} has KV shape {tuple(t.shape)}"
                                 f" with no dimension of {num_blocks} blocks")
            view = t.movedim(dims[0], 0)
            size = view[0].numel() * view.element_size()
            self.views.append(view)
            self.offsets.append((off, off + size))
            off += size
            shapes.append(f"{dims[0]}:{'x'.join(map(str, view.shape[1:]))}")
        dtype = str(self.views[0].dtype).removeprefix("torch.")
        self.layout = f"vllm/{dtype}/{len(self.views)}x" + ",".join(sorted(set(shapes)))
        """Names the dtype and every layer's block shape: records of another layout are misses."""
        self.nbytes = off
        self.direct = all(v.device.type == "cpu" and v.is_contiguous() for v in self.views)
        """Each layer's block is one run of host memory: :meth:`buffers` can hand it out."""
        self._bytes = [v.reshape(v.shape[0], -1).view(torch.uint8).numpy() for v in self.views] \
            if self.direct else []  # per layer: [blocks, bytes] over vLLM's own memory

    def cuts(self, pieces: int) -> tuple[list[int], list[int]]:
        """The row cut into at most ``pieces`` runs of whole layers: the first layer alone (the
        forward pass needs it first: it comes soonest), the rest about equal. Returns (the byte
        offsets, from 0 to :attr:`nbytes`; each layer's piece)."""
        n = len(self.views)
        pieces = max(1, min(pieces, n))
        piece_of = [0] + [1 + (layer - 1) * (pieces - 1) // (n - 1) for layer in range(1, n)] \
            if pieces > 1 else [0] * n
        cuts = [0] + [self.offsets[layer][1] for layer in range(n)
                      if layer + 1 == n or piece_of[layer + 1] != piece_of[layer]]
        return cuts, piece_of

    def buffers(self, block_id: int, start: int, end: int) -> list[memoryview]:
        """Byte views of vLLM block ``block_id``'s own memory holding row bytes ``[start,
        end)`` (layer boundaries; only where :attr:`direct`): bytes written there are the
        block's KV, with no copy."""
        return [layer[block_id].data for layer, (a, b) in zip(self._bytes, self.offsets)
                if a >= start and b <= end]

    def read(self, block_id: int, row: torch.Tensor) -> None:
        """Copy vLLM block ``block_id`` into ``row`` (``[nbytes]`` uint8)."""
        for view, (a, b) in zip(self.views, self.offsets):
            row[a:b].view(view.dtype).view(view.shape[1:]).copy_(view[block_id])

    def write(self, block_id: int, row: torch.Tensor) -> None:
        """Copy ``row`` (``[nbytes]`` uint8) into vLLM block ``block_id``."""
        for view, (a, b) in zip(self.views, self.offsets):
            view[block_id].copy_(row[a:b].view(view.dtype).view(view.shape[1:]))


def row_of(payload: bytes | bytearray) -> torch.Tensor:
    """A uint8 view of ``payload`` without a copy (the caller never writes it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": never written
        return torch.frombuffer(payload, dtype=torch.uint8)
